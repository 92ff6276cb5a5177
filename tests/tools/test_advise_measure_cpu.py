"""advise_measure's code path on CPU: the engine's runner with the recording graph backend standing in for
CUDA graphs, and the few torch.cuda calls made no-ops. Checks the plumbing (what is timed, which memory
figures land where, the KV pool bound back after the probes), not GPU figures: test_advise_gpu does those."""

from __future__ import annotations

import pytest
import torch

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.runner.graphs import CaptureReport, RecordingGraphBackend
from ostinato.sampling_params import SamplingParams
from ostinato.tools.advise import measure as advise_measure
from ostinato.tools.checkpoint import make_checkpoint


def test_measure_plumbing_on_cpu(tmp_path, monkeypatch):
    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama")
    engine = LLMEngine(EngineArgs(model=str(ckpt), device="cpu", dtype="float32", num_kv_blocks=40,
                                  max_model_len=64, max_num_seqs=4))
    runner = engine.runner
    graphs = runner.decode_step.graph_runner((1, 2, 4), False, "error", progress=False,
                                             backend=RecordingGraphBackend())
    graphs.capture()
    runner.graphs = graphs
    runner.capture_report = CaptureReport((1, 2, 4), {4: 7000, 2: 300, 1: 200}, 7000, 0.0)
    for name in ("synchronize", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "cpu (recording backend)")
    bound = []
    real_bind = runner.model.bind_kv_caches
    monkeypatch.setattr(runner.model, "bind_kv_caches", lambda caches: (bound.append(caches), real_bind(caches)))

    m = advise_measure.measure(engine, [8, 40, 500], [16, 32, 500], iters=1, warmup=0)
    assert m.batch_sizes == (1, 2, 4) and m.contexts == (8, 40)  # 500 >= max_model_len: dropped
    assert m.prefill_lens == (16, 32)
    assert all(t > 0 for row in m.eager_ms + m.graph_ms for t in row)
    assert m.graph_incremental_bytes == {4: 7000, 2: 300, 1: 200}
    # recording probes weigh nothing; calibrated to the real capture of the largest size (no KV plan on CPU)
    assert m.graph_first_bytes == {1: 7000, 4: 7000}
    assert m.kv_blocks_without_graphs == 40 + 1  # 7000 B of graphs = one (rounded-up) block given back
    assert bound[-1] is runner.kv_caches  # the probes' temporary pools are not left bound
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert graphs.stats.steps_by_batch  # decode went through the measured graph runner


def test_measure_refuses_an_engine_without_graphs(tmp_path):
    from ostinato.errors import ConfigError

    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="llama")
    engine = LLMEngine(EngineArgs(model=str(ckpt), device="cpu", num_kv_blocks=16, max_model_len=64))
    with pytest.raises(ConfigError, match="graphs are disabled"):
        advise_measure.measure(engine, [8], [8], iters=1, warmup=0)
