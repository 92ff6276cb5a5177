"""Prefix caching and chunked prefill end to end (fp32, CPU): greedy tokens equal HF transformers' and equal
with the features off; cached prompt tokens are reported; every chunk size gives the same tokens."""

import pytest
import torch
from test_e2e_vs_hf import _hf_greedy

from support.graph_engine import engine_with_recorded_graphs
from ostinato import LLM, SamplingParams
from ostinato.config import EngineArgs
from ostinato.tools.checkpoint import make_checkpoint

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"prefix-{request.param}")
    make_checkpoint(path, shape="tiny", family=request.param, seed=11)
    return path


def _shared_prefix_prompts(vocab: int) -> list[list[int]]:
    """Prompts sharing a 48-token prefix to different lengths, on and off block boundaries (blocks of 16)."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(3, vocab, (48,), generator=gen).tolist()
    tail = torch.randint(3, vocab, (8,), generator=gen).tolist()
    return [base[:40] + tail[:1],  # 41 tokens: the first, nothing cached yet
            base[:32] + tail[1:3],  # shares 2 full blocks
            base[:17] + tail[3:5],  # shares 1 block and one token (not a block)
            base[:40] + tail[:1],  # the first prompt again: its last token's block is computed, not shared
            base[:32],  # exactly 2 blocks: the block of its last token is computed again
            base[:5] + tail[5:8],  # shares less than a block
            base[:48]]  # 3 blocks; the first two are cached (the third holds its last token)


EXPECTED_CACHED = [0, 32, 16, 32, 16, 0, 32]


def _llm(path, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 64)
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=128, block_size=BLOCK, **kwargs)


def test_prefix_caching_gives_hf_tokens_and_reports_cached_prompt_tokens(checkpoint):
    llm = _llm(checkpoint)
    prompts = _shared_prefix_prompts(llm.engine.model_config.vocab_size)
    outs = [llm.generate([p], GREEDY)[0] for p in prompts]  # one at a time: each finds what the others left
    assert [o.num_cached_tokens for o in outs] == EXPECTED_CACHED
    cached_tokens = [o.outputs[0].token_ids for o in outs]
    assert cached_tokens == _hf_greedy(checkpoint, prompts, GREEDY.max_tokens)
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (sum(map(len, prompts)), sum(EXPECTED_CACHED))
    assert stats.kv_blocks_free == stats.kv_blocks_total  # cached blocks nobody holds count as free

    off = _llm(checkpoint, enable_prefix_caching=False)
    outs_off = [off.generate([p], GREEDY)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs_off] == cached_tokens
    assert all(o.num_cached_tokens == 0 for o in outs_off)
    assert off.engine.stats().prefix_cache_hits == 0

    # All at once: later prompts read blocks an earlier prompt computes in the same step.
    together = _llm(checkpoint).generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in together] == cached_tokens
    assert sum(o.num_cached_tokens for o in together) > 0


@pytest.mark.parametrize("chunk", [1, 7, 16, 100])
def test_every_chunk_size_gives_the_same_tokens(checkpoint, chunk):
    prompts = _shared_prefix_prompts(_llm(checkpoint, num_kv_blocks=16).engine.model_config.vocab_size)[:4]
    reference = _hf_cached(checkpoint, prompts)
    # A budget of 1 leaves one seat (a step holds max_num_seqs decode tokens); 7 leaves chunks of 7 minus the
    # decoding sequences, so chunk boundaries fall everywhere.
    llm = _llm(checkpoint, max_num_batched_tokens=chunk, max_num_seqs=min(chunk, 4),
               enable_prefix_caching=chunk != 16)
    outs = llm.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert llm.engine.stats().kv_blocks_free == llm.engine.stats().kv_blocks_total


_HF = {}


def _hf_cached(path, prompts):
    key = (str(path), tuple(map(tuple, prompts)))
    if key not in _HF:
        _HF[key] = _hf_greedy(path, prompts, GREEDY.max_tokens)
    return _HF[key]


def test_chunked_prefill_under_preemption_with_sampling_and_no_overlap(checkpoint):
    """A tight cache (preemption with prefix caching, so recomputes hit their own blocks), seeded sampling,
    with and without overlapped scheduling: the same tokens as a roomy unchunked engine."""
    prompts = _shared_prefix_prompts(_llm(checkpoint, num_kv_blocks=16).engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=10, ignore_eos=True)
    roomy = [o.outputs[0].token_ids for o in _llm(checkpoint, num_kv_blocks=128, max_num_batched_tokens=512,
                                                    enable_prefix_caching=False).generate(prompts, params)]
    for overlap in (True, False):
        tight = _llm(checkpoint, num_kv_blocks=9, max_num_batched_tokens=24, max_num_seqs=8,
                     async_scheduling=overlap)
        assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == roomy
        stats = tight.engine.stats()
        assert stats.num_preemptions > 0 and stats.kv_blocks_free == stats.kv_blocks_total
        assert stats.prefix_cache_hits > 0


def test_mixed_steps_on_the_graph_path_give_the_eager_tokens(checkpoint):
    """Decode rows replay a (recorded) graph while prompts are prefilled in chunks beside them."""
    prompts = _shared_prefix_prompts(_llm(checkpoint, num_kv_blocks=16).engine.model_config.vocab_size)
    args = EngineArgs(str(checkpoint), device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64,
                      max_num_batched_tokens=12, max_num_seqs=8)
    engine = engine_with_recorded_graphs(args, (1, 2, 4, 8))
    kinds = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: kinds.append((out := schedule()).kind) or out
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done[str(i)] for i in range(len(prompts))] == _hf_cached(checkpoint, prompts)
    stats = engine.stats()
    assert stats.decode_steps_graph > 0 and stats.decode_steps_eager == 0
    assert kinds.count("mixed") >= 5  # prompts of up to 48 tokens in chunks of 12 beside running decodes
