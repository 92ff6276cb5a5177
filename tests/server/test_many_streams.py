"""A real `ostinato serve` process (tiny checkpoint, CPU, loopback) at the concurrency of a full default batch:
256 streams at once, twice over, loaded by `bench serve`'s client. Every stream must finish with all its tokens
and nothing may be refused (a 429 from the waiting queue's bound, a connection the server could not take).
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("uvicorn")

from support.served import Served  # noqa: E402

from ostinato.config import SERVER_MAX_QUEUED_REQUESTS  # noqa: E402
from ostinato.tools.bench.serve import BenchConfig, run_benchmark  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

STREAMS = 256  # the default --max-num-seqs and --max-queued-requests: a full batch, and a full queue behind it


def test_a_full_batch_of_streams_all_finish_twice_over(tmp_path):
    assert SERVER_MAX_QUEUED_REQUESTS == STREAMS  # the bound this load must stay inside of
    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama", seed=3)
    served = Served(ckpt, "--max-num-seqs", str(STREAMS), "--num-kv-blocks", str(2 * STREAMS + 16))
    try:
        cfg = BenchConfig(base_url=served.url, num_prompts=2 * STREAMS, max_concurrency=STREAMS, input_len=8,
                          output_len=6, timeout_s=60.0)
        summary = asyncio.run(asyncio.wait_for(run_benchmark(cfg), 120))
    finally:
        served.kill()
    assert summary["errors"] == [] and summary["failed"] == 0, summary["errors"]
    assert summary["completed"] == 2 * STREAMS
    assert summary["total_output_tokens"] == 2 * STREAMS * 6
    assert summary["total_output_chunks"] >= 2 * STREAMS  # every stream streamed, none came back whole
