"""--batch-invariant on the GPU, bf16, CUDA graphs on: 200 requests under continuous batching with random arrivals,
random prompt lengths, a shared prefix (cached blocks) and a small step budget (chunked prefill, mixed steps), each
compared bit for bit with its solo run: tokens, the sampled token's logprob and the top 5, greedy and seeded.

The shape is OSTINATO_INVARIANT_SHAPE (default llama-3.1-8b; llama-3.2-1b writes its random checkpoint in a
fraction of the time). Run: `PYTHONPATH=src python -m pytest -m gpu tests/e2e/test_batch_invariant_gpu.py`.
"""

from __future__ import annotations

import os

import pytest
import torch

from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams
from ostinato.tools.checkpoint import make_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
NUM_REQUESTS = 200


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    shape = os.environ.get("OSTINATO_INVARIANT_SHAPE", "llama-3.1-8b")
    path = tmp_path_factory.mktemp(f"invariant-{shape}")
    make_checkpoint(path, shape=shape, seed=2, dtype="bfloat16")
    # A step budget of 256 tokens: long prompts are chunked and share steps with the decode rows.
    return LLMEngine(EngineArgs(model=str(path), dtype="bfloat16", batch_invariant=True, max_model_len=1024,
                                max_num_seqs=64, max_num_batched_tokens=256, gpu_memory_utilization=0.6))


def _requests(vocab: int, seeded: bool) -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(17)
    prefix = torch.randint(3, vocab, (96,), generator=gen).tolist()  # six blocks of 16 shared by a third of them
    out = []
    for i in range(NUM_REQUESTS):
        n = int(torch.randint(1, 400, (1,), generator=gen))
        prompt = torch.randint(3, vocab, (n,), generator=gen).tolist()
        if i % 3 == 0:
            prompt = prefix + prompt[:200]
        max_tokens = int(torch.randint(4, 24, (1,), generator=gen))
        params = SamplingParams(temperature=0.8 if seeded else 0.0, seed=i if seeded else None,
                                max_tokens=max_tokens, ignore_eos=True, logprobs=5)
        out.append((prompt, params))
    return out


def _trace(completion) -> list[tuple]:
    return [(lp.token_id, lp.logprob, tuple(lp.top)) for lp in completion.logprobs]


def _solo(engine: LLMEngine, requests) -> list[list[tuple]]:
    traces = []
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"solo{i}", prompt, params)
        done = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done = out.outputs[0]
        traces.append(_trace(done))
    return traces


def _batched(engine: LLMEngine, requests, seed: int) -> list[list[tuple]]:
    """Random arrivals: each step 0-4 new requests join whatever runs (batches of every size, padded to the
    captured graph sizes, mixed steps beside chunked prompts)."""
    gen = torch.Generator().manual_seed(seed)
    pending = list(enumerate(requests))
    done: dict[int, object] = {}
    while pending or engine.has_unfinished():
        for _ in range(int(torch.randint(0, 5, (1,), generator=gen))):
            if pending:
                i, (prompt, params) = pending.pop(0)
                engine.add_request(f"b{seed}-{i}", prompt, params)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.split("-")[1])] = out.outputs[0]
    return [_trace(done[i]) for i in range(len(requests))]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_every_request_equals_its_solo_run(engine, seeded):
    requests = _requests(engine.model_config.vocab_size, seeded)
    solo = _solo(engine, requests)
    batched = _batched(engine, requests, seed=1 + seeded)
    differ = [i for i, (a, b) in enumerate(zip(solo, batched)) if a != b]
    assert not differ, f"{len(differ)} of {NUM_REQUESTS} requests differ from their solo run: {differ[:10]}"
    stats = engine.stats()
    assert stats.batch_invariant and stats.graphs_enabled
    assert stats.padded_rows > 0 and stats.prefix_cache_hits > 0 and stats.decode_steps_mixed + \
        stats.prefill_steps_graph > 0
