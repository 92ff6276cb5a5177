"""Structured outputs on a GPU: constrained rows inside graph-replayed decode steps (the mask applied eagerly
after the replay) hold their regex / choice, leave the batch's unconstrained rows' tokens unchanged, and every
decode step is still one replay. Skipped without CUDA (and without xgrammar)."""

import re

import pytest
import torch

pytest.importorskip("xgrammar")

from ostinato.config import EngineArgs  # noqa: E402
from ostinato.engine.llm import LLM  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402
from ostinato.structured_outputs import StructuredOutputs  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-structured")
    make_checkpoint(path, shape="tiny", family="qwen3", seed=5, dtype="bfloat16")
    # A share of the GPU, not the default 0.9: other modules' engines may still hold theirs in a whole-suite run.
    return LLM.from_engine_args(EngineArgs(model=str(path), max_model_len=256, max_num_seqs=16,
                                           gpu_memory_utilization=0.3))


def test_constrained_rows_in_graph_steps(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=9, max_tokens=24, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(["hello", "world"], plain)]
    before = llm.engine.stats()
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                                  structured_outputs=StructuredOutputs(regex="[0-9]{3}-[a-z]{2}")) for s in range(6)]
    constrained += [SamplingParams(temperature=1.0, seed=s, max_tokens=24,
                                   structured_outputs=StructuredOutputs(choice=("alpha", "beta gamma")))
                    for s in range(6)]
    outs = llm.generate(["hello", "world"] + ["x"] * 12, plain + constrained)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    texts = [o.outputs[0].text for o in outs]
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", t) for t in texts[2:8]), texts
    assert all(o.outputs[0].text in ("alpha", "beta gamma") for o in outs[8:])
    after = llm.engine.stats()
    assert after.graphs_enabled and after.decode_steps_graph > before.decode_steps_graph
    assert after.decode_steps_eager == before.decode_steps_eager  # the masks never turned a step eager
