"""The server's `ostinato:decode_batch_size` histogram: counted by the real engine on CPU, exported in the
Prometheus text of ServerMetrics and of a live server's /metrics, and read back by `advise --from-metrics`."""

from __future__ import annotations

import collections

import httpx
import pytest

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.errors import ConfigError
from ostinato.sampling_params import SamplingParams
from ostinato.server.metrics import ServerMetrics
from ostinato.tools.advise.workload import workload_from_metrics
from ostinato.tools.checkpoint import make_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    ckpt = make_checkpoint(tmp_path_factory.mktemp("advise") / "ckpt", shape="tiny", family="llama")
    return LLMEngine(EngineArgs(model=str(ckpt), device="cpu", dtype="float32", num_kv_blocks=64,
                                max_model_len=128, max_num_seqs=8))


def run_and_count(engine) -> collections.Counter:
    """Run requests of different lengths (so the batch shrinks as they finish) and count, independently of
    the engine's counters, the batch size of every decode step the runner executed."""
    seen: collections.Counter = collections.Counter()
    launch = engine.runner.launch

    def counting(out):
        if out.kind == "decode":
            seen[out.num_decode] += 1
        return launch(out)

    engine.runner.launch = counting
    try:
        for i, n in enumerate((2, 5, 9, 9, 3)):
            engine.add_request(f"r{i}", [1, 2, 3, 4 + i], SamplingParams(temperature=0.0, max_tokens=n,
                                                                         ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.launch = launch
    return seen


def test_histogram_counts_every_decode_step_and_parses_back(engine):
    before = dict(engine.stats().decode_batch_sizes)
    seen = run_and_count(engine)
    stats = engine.stats()
    got = collections.Counter(stats.decode_batch_sizes)
    got.subtract(before)
    assert +got == seen and len(seen) > 2  # several batch sizes, each counted once per step
    text = ServerMetrics("tiny").render(stats)[0].decode()
    assert 'ostinato:decode_batch_size_bucket{le="8.0",model_name="tiny"}' in text  # a bucket per size
    w = workload_from_metrics(text)
    assert w.batch_histogram == {n: float(c) for n, c in stats.decode_batch_sizes.items()}


def test_parsing_rejects_text_without_the_histogram():
    with pytest.raises(ConfigError, match="no ostinato:decode_batch_size"):
        workload_from_metrics("# TYPE x counter\nx_total 1\n")


def test_wide_buckets_are_charged_at_their_upper_bound():
    text = ('# TYPE ostinato:decode_batch_size histogram\n'
            'ostinato:decode_batch_size_bucket{le="1"} 4\nostinato:decode_batch_size_bucket{le="8"} 10\n'
            'ostinato:decode_batch_size_bucket{le="+Inf"} 12\nostinato:decode_batch_size_count 12\n'
            'ostinato:decode_batch_size_sum 50\n')
    assert workload_from_metrics(text).batch_histogram == {1: 4.0, 8: 6.0}


def test_advise_reads_a_live_servers_metrics(engine, tmp_path, capsys):
    """`advise --from-metrics URL` against the real /metrics endpoint of a running server."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("fastapi")
    from test_advise import synthetic
    from test_server import TestServer

    from ostinato.cli import main

    server = TestServer(engine, api_key=None)
    try:
        for i in range(3):
            r = httpx.post(server.base_url + "/v1/completions", timeout=30,
                           json={"model": "tiny-llama", "prompt": [1, 2, 3 + i], "max_tokens": 4 + 3 * i,
                                 "temperature": 0.0, "ignore_eos": True})
            assert r.status_code == 200, r.text
        expected = server.stats().decode_batch_sizes
        synthetic(max_num_seqs=8).save(tmp_path / "m.json")
        rc = main(["advise", "tiny", "--measurements", str(tmp_path / "m.json"), "--from-metrics",
                   server.base_url + "/metrics", "--out", str(tmp_path), "--no-plots"])
    finally:
        server.stop()
    assert rc == 0
    out = capsys.readouterr().out
    assert f"workload: metrics of {server.base_url}/metrics" in out
    assert "prefill: 3 requests of" in out  # request and token counters read from the real exposition too
    # the recommended sizes cover only batch sizes the server ran
    sizes = [int(s) for s in (tmp_path / "cuda_graph_sizes.txt").read_text().split("\n")[1].split()]
    assert sizes and set(sizes) <= set(expected)
