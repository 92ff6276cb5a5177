"""benchmarks/online/serve_vs_offline.py compares the server and LLM.generate at one step budget."""

import importlib.util
from pathlib import Path

from ostinato.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, OFFLINE_MAX_NUM_BATCHED_TOKENS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "online" / "serve_vs_offline.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_vs_offline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llm_generate_gets_the_servers_budget_unless_the_flags_set_one():
    offline_argv = _script()._offline_argv
    assert DEFAULT_MAX_NUM_BATCHED_TOKENS != OFFLINE_MAX_NUM_BATCHED_TOKENS  # else there is nothing to align
    assert offline_argv(["--max-num-seqs", "64"]) == [
        "--max-num-seqs", "64", "--max-num-batched-tokens", str(DEFAULT_MAX_NUM_BATCHED_TOKENS)]
    big = 2 * DEFAULT_MAX_NUM_BATCHED_TOKENS  # the server's budget is at least --max-num-seqs
    assert offline_argv(["--max-num-seqs", str(big)])[-1] == str(big)
    for given in (["--max-num-batched-tokens", "512"], ["--max-num-batched-tokens=512"]):
        assert offline_argv(["--max-num-seqs", "8", *given]) == ["--max-num-seqs", "8", *given]


def test_the_gc_report_counts_the_collections_logged_during_the_load_by_generation(tmp_path):
    import json

    script, path = _script(), str(tmp_path / "front.json")
    with open(path, "w") as f:  # (ended at, generation, seconds)
        json.dump([(9.0, 2, 0.5), (10.0, 0, 0.001), (10.5, 0, 0.003), (11.0, 2, 0.120), (13.0, 1, 0.2)], f)
    assert script._gc_report(path, 10.0, 12.0) == ("gen0 2 x, 4 ms in all, longest 3.0 ms; "
                                                   "gen2 1 x, 120 ms in all, longest 120.0 ms")
    assert script._gc_report(path, 20.0, 30.0) == "none"
    assert script._gc_report(str(tmp_path / "missing.json"), 0.0, 1.0) == "no log"


def test_front_reader_cost_times_each_piece_of_the_readers_work(capsys):
    """A smoke of benchmarks/online/front_reader_cost.py at a small size: each piece is timed and printed."""
    path = SCRIPT.parent / "front_reader_cost.py"
    spec = importlib.util.spec_from_file_location("front_reader_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--streams", "4", "--steps", "2", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in lines] == [
        "unpickle the step's message", "output_from_record", "ServerMetrics.on_step"]
    assert all("us per record" in line for line in lines)
