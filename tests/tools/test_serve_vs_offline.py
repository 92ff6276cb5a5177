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
