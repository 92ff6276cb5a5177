"""benchmarks/online/serve_vs_offline.py runs LLM.generate at the server's step policy, and reports the garbage
collections during a load run."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "online" / "serve_vs_offline.py"


def _script():
    spec = importlib.util.spec_from_file_location("serve_vs_offline", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llm_generate_gets_the_servers_cap_unless_the_flags_set_one_or_its_own_policy_is_asked(tmp_path):
    from ostinato.config import DEFAULT_PREFILL_GRAPH_TOKENS

    engine_args = _script()._offline_engine_args
    largest = DEFAULT_PREFILL_GRAPH_TOKENS[-1]
    assert engine_args("m", ["--max-num-seqs", "64"], False).max_prefill_tokens_while_decoding == largest - 64
    assert engine_args("m", ["--max-num-seqs", "64", "--max-prefill-tokens-while-decoding", "96"],
                       False).max_prefill_tokens_while_decoding == 96
    assert engine_args("m", ["--max-num-seqs", "64"], True).max_prefill_tokens_while_decoding is None


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
