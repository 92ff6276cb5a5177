"""`ostinato bench prefix` and `ostinato bench chunked` run end to end on a tiny checkpoint (a smoke test: the
figures are the GPU's to give; here only what they report is checked)."""

import json

import pytest

from ostinato.cli import main
from ostinato.tools.checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-prefill")
    make_checkpoint(path, shape="tiny", family="llama", seed=3)
    return path


COMMON = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", "8", "--num-kv-blocks", "64"]


def test_bench_prefix_reports_the_cached_tokens(checkpoint, tmp_path):
    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", str(checkpoint), *COMMON, "--prompt-len", "80", "--cached-len", "48",
                 "--iters", "2", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["cached_tokens_reported"] == [48, 48]
    assert result["ttft_cached_ms"] > 0 and result["ratio"] == result["ttft_cached_ms"] / result["ttft_uncached_ms"]


def test_bench_prefix_refuses_prefix_caching_off(checkpoint, capsys):
    assert main(["bench", "prefix", str(checkpoint), *COMMON, "--no-enable-prefix-caching", "--prompt-len", "40",
                 "--cached-len", "16", "--iters", "1"]) == 2
    assert "drop --no-enable-prefix-caching" in capsys.readouterr().err


def test_bench_chunked_prefills_in_chunks_beside_the_decodes(checkpoint, tmp_path):
    out = tmp_path / "chunked.json"
    assert main(["bench", "chunked", str(checkpoint), *COMMON, "--max-num-batched-tokens", "24",
                 "--prompt-len", "100", "--num-decodes", "4", "--decode-context", "8", "--base-steps", "6",
                 "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["steps_during_prefill"] >= 100 // (24 - 4)  # chunks of what the 4 decode rows leave
    assert result["itl_p99_ms_during_prefill"] > 0 and result["max_num_batched_tokens"] == 24
    assert len(result["rounds"]) == 2 and all(r["step_ms"] for r in result["rounds"])  # default --rounds 2


def test_bench_chunked_refuses_zero_rounds(checkpoint, capsys):
    assert main(["bench", "chunked", str(checkpoint), *COMMON, "--rounds", "0"]) == 2
    assert "--rounds must be >= 1" in capsys.readouterr().err
