"""`ostinato advise` measuring on a real GPU (skipped without one): the figures are sane, memory adds up with
the KV plan, the engine still serves afterwards, and the measurements drive a report."""

from __future__ import annotations

import pytest
import torch

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams
from ostinato.tools.advise.costs import CostModel, Measurements
from ostinato.tools.advise.estimate import advise
from ostinato.tools.advise.measure import measure
from ostinato.tools.advise.workload import workload_from_params
from ostinato.tools.checkpoint import make_checkpoint

pytestmark = pytest.mark.gpu


def test_measure_on_the_gpu_then_advise(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", shape="tiny", family="qwen3", dtype="bfloat16")
    engine = LLMEngine(EngineArgs(model=str(ckpt), device="cuda", max_model_len=512, max_num_seqs=16,
                                  cuda_graph_sizes=(1, 2, 4, 8, 16), gpu_memory_utilization=0.3,
                                  prefill_graph_tokens="none"))  # advise is about decode graphs: the plan's
    # graph estimate is then theirs alone (prefill graphs would add their own to it)
    m = measure(engine, [64, 256], [32, 128], iters=10, warmup=3)
    assert m.batch_sizes == (1, 2, 4, 8, 16) and m.contexts == (64, 256)
    for e_row, g_row in zip(m.eager_ms, m.graph_ms):
        assert g_row[0] < e_row[0], "one replay must beat the eager launches of a tiny model at batch 1"
    assert all(t > 0 for t in m.prefill_ms)
    plan = engine.runner.kv_plan
    assert m.graph_first_bytes[16] == plan.graph_estimate_bytes > 0
    assert m.kv_blocks_without_graphs == plan.num_blocks + plan.graph_blocks
    assert Measurements.from_json(m.to_json()) == m
    # the probes re-bound the real KV pool: the engine still generates
    engine.add_request("after", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert len(outs[-1].outputs[0].token_ids) == 4
    a = advise(CostModel(m), workload_from_params("20:100", "20:60", 32, None, 8))
    assert a.recommended.sizes and set(a.recommended.sizes) <= set(range(1, 17))
    assert a.recommended.graph_bytes <= a.budget_bytes
    torch.cuda.synchronize()
