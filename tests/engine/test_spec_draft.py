"""Speculative decoding with a draft model (--speculative-method draft) through the whole engine on CPU (random
tiny llamas, fp32).

Two drafts: the target's own checkpoint, whose proposals are the target's tokens wherever the draft's KV cache
holds what the target's holds (so any acceptance below 100% means the draft's cache went wrong: a rejected
proposal's K/V kept, a position missed after all proposals were accepted, a prefix-cache block without the
draft's K/V, a recompute that skipped it), and a checkpoint of another seed, whose proposals are almost all
rejected. Greedy output must equal the plain run's with both, and every KV block must be free afterwards."""

import numpy as np
import pytest

from ostinato import LLM, SamplingParams
from ostinato.errors import ConfigError
from ostinato.tools.checkpoint import make_checkpoint
from support.graph_engine import recorded_graphs

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)), [7, 7, 7, 7],
           [3, 4, 5, 6, 3, 4], [9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    paths = {}
    for name, shape, seed in (("target", "tiny", 1), ("other", "tiny", 2), ("vocab509", "tiny-mqa", 1)):
        paths[name] = str(make_checkpoint(tmp_path_factory.mktemp(f"draft-{name}"), shape=shape, family="llama",
                                          seed=seed))
    return paths


def make(ckpts, draft=None, **kw):
    args = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=96, block_size=4)
    args.update(kw)
    if draft is not None:
        args.update(speculative_method="draft", speculative_model=ckpts[draft], num_speculative_tokens=args.pop("k", 4))
    return LLM(ckpts["target"], **args)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_clean(llm):
    st = llm.engine.stats()
    assert st.num_running == st.num_waiting == 0 and st.kv_blocks_free == st.kv_blocks_total


def acceptance(llm) -> float:
    st = llm.engine.stats()
    assert st.spec_decode_draft_tokens > 0
    return st.spec_decode_accepted_tokens / st.spec_decode_draft_tokens


@pytest.fixture(scope="module")
def plain(ckpts):
    return tokens(make(ckpts).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_greedy_output_is_unchanged_with_the_targets_own_checkpoint_as_draft(ckpts, plain, max_num_seqs):
    llm = make(ckpts, "target", max_num_seqs=max_num_seqs)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    assert acceptance(llm) == 1.0
    assert_clean(llm)


@pytest.mark.parametrize("max_num_seqs, k", [(2, 3), (8, 5)])
def test_greedy_output_is_unchanged_with_a_draft_that_is_mostly_wrong(ckpts, plain, max_num_seqs, k):
    llm = make(ckpts, "other", max_num_seqs=max_num_seqs, k=k)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    assert acceptance(llm) < 0.2
    assert_clean(llm)


@pytest.mark.parametrize("kw", [dict(num_kv_blocks=26, max_num_seqs=6),
                                dict(max_num_seqs=4, max_num_batched_tokens=12)], ids=["preemption", "chunked-prefill"])
def test_preemption_and_chunked_prefill_keep_both_caches_consistent(ckpts, plain, kw):
    """A small pool preempts (both caches recomputed from the prompt); a step budget of 12 tokens prefills in
    chunks beside the verify rows: the own-checkpoint draft still proposes exactly the target's tokens."""
    llm = make(ckpts, "target", **kw)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    if "num_kv_blocks" in kw:
        assert llm.engine.stats().num_preemptions > 0
    assert acceptance(llm) == 1.0
    assert_clean(llm)


def test_prefix_cache_hits_serve_blocks_that_hold_the_drafts_kv_too(ckpts, plain):
    """Each prompt again with its first 13 generated tokens: the cache serves blocks written by verify and
    draft steps (13 ends a run where every proposal was accepted: the draft lags one position there)."""
    llm = make(ckpts, "target", k=3)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    longer = [p + r[0][:13] for p, r in zip(PROMPTS, plain)]
    want = tokens(make(ckpts).generate(longer, GREEDY))
    before = llm.engine.stats()
    assert tokens(llm.generate(longer, GREEDY)) == want
    after = llm.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 4 * len(longer)
    assert after.spec_decode_accepted_tokens - before.spec_decode_accepted_tokens == \
        after.spec_decode_draft_tokens - before.spec_decode_draft_tokens
    assert_clean(llm)


def test_draft_steps_replay_the_drafts_own_prefill_graphs(ckpts, plain):
    """With prefill graphs (recorded, on CPU: the captured code run as it is) the draft captures its own and its
    steps replay them; the output and the full acceptance hold."""
    with recorded_graphs((1, 4), prefill_sizes=(8, 16, 32), prefill_max_seqs=4):
        llm = make(ckpts, "target", max_num_seqs=4)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    assert acceptance(llm) == 1.0
    assert llm.engine.runner.draft.prefill_graphs.stats().graph_steps > 10
    assert_clean(llm)


def test_sampled_rows_accept_every_proposal_of_an_identical_draft(ckpts):
    """p == q at every proposed position (the draft is the target): min(1, p/q) = 1, nothing is rejected."""
    llm = make(ckpts, "target", max_num_seqs=4)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=16, ignore_eos=True, n=2)
    out = llm.generate(PROMPTS[:3], params)
    assert all(len(c.token_ids) == 16 for o in out for c in o.outputs)
    assert acceptance(llm) > 0.95
    assert_clean(llm)


def test_a_draft_of_another_vocabulary_is_refused(ckpts):
    with pytest.raises(ConfigError, match="vocabulary of 509 tokens, the model 512"):
        make(ckpts, "vocab509")



def test_sampled_tokens_with_a_near_draft_follow_the_models_distribution_chi_square(ckpts, tmp_path):
    """End to end, rejection sampling against a draft that agrees in part (the model's weights plus noise, so
    proposals are both accepted and rejected): 400 sequences of one prompt at temperature 1 with top-k 3 (engine
    seed 1), each verifying one proposal for its second token. Grouped by the first token (one context per
    group), the second token follows the model's own distribution there, which the sequences' logprobs give (the
    raw distribution's top 3, renormalised). Fails below a p-value of 1e-3 in any group of 80 or more. The
    exact rule is tested on more draws in tests/runner/test_spec_verify.py; this is the engine's plumbing."""
    from scipy.stats import chisquare

    near = noisy_copy(ckpts["target"], tmp_path / "near", noise=0.1)
    llm = LLM(ckpts["target"], device="cpu", dtype="float32", block_size=4, num_kv_blocks=800, max_model_len=16,
              max_num_seqs=200, seed=1, speculative_method="draft", speculative_model=near, num_speculative_tokens=1)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True, logprobs=3, n=400)
    groups: dict[int, list] = {}
    for c in llm.generate([[3, 1, 4, 1, 5]], params)[0].outputs:
        groups.setdefault(c.token_ids[0], []).append((c.token_ids[1], c.logprobs[1].top))
    tested = 0
    for samples in groups.values():
        if len(samples) < 80:
            continue
        top = samples[0][1]  # the model's top 3 at the second position: one context for the whole group
        p = np.exp([lp for _, lp in top])
        counts = np.array([sum(t == i for t, _ in samples) for i, _ in top])
        assert counts.sum() == len(samples)  # no token outside the top 3
        expected = p / p.sum() * len(samples)
        assert chisquare(counts, expected).pvalue > 1e-3, (counts, expected)
        tested += 1
    assert tested >= 2
    st = llm.engine.stats()
    assert 0.1 < st.spec_decode_accepted_tokens / st.spec_decode_draft_tokens < 0.9  # accepted and rejected
    assert_clean(llm)


def noisy_copy(src: str, dst, noise: float) -> str:
    """A copy of checkpoint src whose matrices carry Gaussian noise of `noise` times their own std."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(f"{dst}/model.safetensors")
    gen = torch.Generator().manual_seed(0)
    weights = {k: v + noise * v.std() * torch.randn(v.shape, generator=gen) if v.ndim > 1 else v
               for k, v in weights.items()}
    save_file(weights, f"{dst}/model.safetensors", metadata={"format": "pt"})
    return str(dst)
