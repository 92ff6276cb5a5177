"""Prefix caching and chunked prefill on the GPU (bf16, Triton attention, CUDA-graph decode beside eager chunks):
logprob-close to an engine with both off, cached tokens reported, every decode step a replay."""

import pytest
import torch
from test_gpu_e2e import TOP, close_until_divergence

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams
from ostinato.tools.checkpoint import make_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-prefix")
    make_checkpoint(path, shape="tiny", family="llama", seed=5, dtype="bfloat16")
    return path


def _run(engine: LLMEngine, prompts: list[list[int]]) -> dict:
    for i, p in enumerate(prompts):  # staggered: later prompts arrive while earlier ones decode
        engine.add_request(f"p{i}", p, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=TOP))
        engine.step()
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_prefix_caching_and_chunks_stay_logprob_close_on_the_graph_path(ckpt):
    gen = torch.Generator().manual_seed(2)
    base = torch.randint(3, 500, (200,), generator=gen).tolist()
    prompts = [base[:n] + torch.randint(3, 500, (k,), generator=gen).tolist()
               for n, k in ((200, 3), (160, 9), (33, 40), (200, 3), (96, 1), (17, 120))]
    common = dict(model=str(ckpt), dtype="bfloat16", max_model_len=512, num_kv_blocks=256, max_num_seqs=16)
    on = LLMEngine(EngineArgs(**common, max_num_batched_tokens=48))
    off = LLMEngine(EngineArgs(**common, max_num_batched_tokens=512, enable_prefix_caching=False))
    a, b = _run(on, prompts), _run(off, prompts)
    compared = sum(close_until_divergence(a[k].outputs[0].token_ids, a[k].outputs[0].logprobs,
                                          b[k].outputs[0].token_ids, b[k].outputs[0].logprobs) for k in a)
    assert compared >= 40
    assert sum(o.num_cached_tokens for o in a.values()) >= 200 and all(o.num_cached_tokens == 0 for o in b.values())
    s = on.stats()
    assert s.decode_steps_graph > 0 and s.decode_steps_eager == 0 and s.kv_blocks_free == s.kv_blocks_total
