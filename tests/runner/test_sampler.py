"""Sampler: greedy, seeds, distributions, top-k / top-p / temperature, logprobs (CPU; one GPU test)."""

from __future__ import annotations

import math

import pytest
import torch

from ostinato.engine.request import ScheduledSeq
from ostinato.runner.sampler import Sampler, SamplingBatch, draw_seed, row_key, uniform
from ostinato.sampling_params import SamplingParams


def seqs_for(params: list[SamplingParams], num_generated: int | list[int] = 0) -> list[ScheduledSeq]:
    counts = num_generated if isinstance(num_generated, list) else [num_generated] * len(params)
    return [
        ScheduledSeq(seq_id=i, token_ids=(1,), start_pos=0, block_table=(0,), sampling_params=p, num_generated=k)
        for i, (p, k) in enumerate(zip(params, counts))
    ]


def sample(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams], num_generated=0):
    batch = sampler.prepare(seqs_for(params, num_generated))
    return sampler(logits, batch)


def draw_counts(probs: list[float], params: SamplingParams, rows: int = 20000, seed: int = 0) -> torch.Tensor:
    """Sample `rows` times from one distribution (one batched call); counts per token [V]."""
    logits = torch.tensor(probs).log().expand(rows, -1).contiguous()  # [rows, V]
    out = sample(Sampler("cpu", seed), logits, [params] * rows)
    return torch.bincount(out.token_ids, minlength=len(probs)).double()


def chi_square(counts: torch.Tensor, expected_probs: list[float]) -> float:
    expected = torch.tensor(expected_probs, dtype=torch.float64) * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token whose probability is 0"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# 99.9th percentile of chi-square with df = 1..5: a correct sampler fails these about once in 1000 seeds
# (and the engine seed is fixed, so a pass is stable).
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def test_greedy_is_argmax():
    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(0))
    out = sample(Sampler("cpu", 0), logits, [SamplingParams(temperature=0.0)] * 16)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.logprobs is None and out.top_ids is None


def test_greedy_rows_in_a_mixed_batch_and_tiny_temperature():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1e-7),  # below the greedy cut-off
        SamplingParams(temperature=0.8, top_k=5, seed=3),
        SamplingParams(temperature=0.0, top_p=0.5, top_k=2),  # top-k/p do not change a greedy row
        SamplingParams(temperature=1.0, top_p=0.9),
    ]
    ids = sample(Sampler("cpu", 0), logits, params).token_ids
    for row in (0, 2, 4):
        assert ids[row] == logits[row].argmax()


def test_input_logits_are_not_modified():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    sample(Sampler("cpu", 0), logits, [SamplingParams(top_k=3, top_p=0.5, logprobs=2)] * 4)
    assert torch.equal(logits, before)


def test_batch_flags_describe_the_rows():
    sampler = Sampler("cpu", 0)
    batch: SamplingBatch = sampler.prepare(seqs_for([
        SamplingParams(temperature=0.0, top_k=50),  # greedy: its top-k does not count
        SamplingParams(top_k=7, logprobs=3, temperature=0.5),
        SamplingParams(top_p=0.9, seed=5),
    ], num_generated=[0, 4, 9]))
    assert batch.any_filtered and batch.max_num_logprobs == 3 and batch.num_logprobs == (None, 3, None)
    assert batch.temperature.tolist() == [0.0, 0.5, 1.0] and batch.top_k.tolist() == [0, 7, 0]
    assert batch.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9]) and batch.counter.tolist() == [0, 4, 9]
    assert batch.key[2].item() == row_key(5, 12345, 99)  # a seeded key depends on the seed alone
    plain = sampler.prepare(seqs_for([SamplingParams(temperature=0.0), SamplingParams()]))
    assert not plain.any_filtered and plain.max_num_logprobs is None and plain.num_logprobs is None


def test_device_hash_matches_its_host_reference():
    # The decode graph draws u on the device; draw_seed is the same hash in Python integers.
    seeds, counters = [0, 1, -1, 2**63 + 5, 12345], [0, 1, 7, 1000, 2**20]
    keys = torch.tensor([row_key(s, 0, 0) for s in seeds for _ in counters])
    ctr = torch.tensor([k for _ in seeds for k in counters])
    expected = [(draw_seed(s, k) >> 40) / 2**24 for s in seeds for k in counters]
    assert uniform(keys, ctr).tolist() == expected
    assert len(set(expected)) == len(expected)


def test_uniform_is_uniform():
    u = uniform(torch.full((200_000,), row_key(3, 0, 0)), torch.arange(200_000))
    assert 0.0 <= u.min() and u.max() < 1.0
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (counts - 20_000).abs().max() < 600  # ~4 sigma


def test_flags_at_their_edges_top_k_1_and_defaults():
    sampler = Sampler("cpu", 0)
    plain = sampler.prepare(seqs_for([SamplingParams(temperature=1.0)]))
    assert not plain.any_filtered and plain.top_p.tolist() == [1.0]  # top_p 1.0 filters nothing
    one = sampler.prepare(seqs_for([SamplingParams(temperature=1.0, top_k=1)]))
    assert one.any_filtered and one.top_k.tolist() == [1]
    # top_k=1 at temperature 1 is the argmax, every time.
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0, top_k=1)] * 64
    assert sample(sampler, logits, params).token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_0_and_minus_1_both_mean_no_filter():
    off = Sampler("cpu", 0).prepare(seqs_for([SamplingParams(temperature=1.0, top_k=0),
                                              SamplingParams(temperature=1.0, top_k=-1)]))
    assert not off.any_filtered and off.top_k.tolist() == [0, 0] and off.top_p.tolist() == [1.0, 1.0]


def test_greedy_rows_draw_nothing_and_set_no_sampling_flags():
    from ostinato.runner.sampler import GREEDY_TEMPERATURE

    sampler = Sampler("cpu", 0)
    greedy = sampler.prepare(seqs_for([
        SamplingParams(temperature=0.0, top_p=0.5, top_k=5, seed=3),  # settings a greedy row ignores
        SamplingParams(temperature=GREEDY_TEMPERATURE / 2),  # tiny temperature: greedy too
    ]))
    assert greedy.temperature.tolist() == [0.0, 0.0] and not greedy.any_filtered
    assert greedy.top_k.tolist() == [0, 0] and greedy.top_p.tolist() == [1.0, 1.0]
    at_threshold = sampler.prepare(seqs_for([SamplingParams(temperature=GREEDY_TEMPERATURE)]))
    assert at_threshold.temperature.tolist() == pytest.approx([GREEDY_TEMPERATURE])


# ---- seeds ----------------------------------------------------------------------------------------------


def test_same_seed_same_tokens_whatever_the_batch():
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(1000, generator=gen)  # [V] a flat-ish distribution: draws vary a lot
    others = torch.randn(5, 1000, generator=gen)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    crowd = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=10, seed=9),
             SamplingParams(temperature=0.5, top_p=0.5), SamplingParams(logprobs=2)]
    alone, crowded = [], []
    for step in range(12):
        # Alone, on an engine with one seed ...
        alone.append(int(sample(Sampler("cpu", 0), target[None], [seeded], step).token_ids[0]))
        # ... and at a different row among other requests, on an engine with another seed.
        row = step % 6
        logits = torch.cat([others[:row], target[None], others[row:]])
        params = crowd[:row] + [seeded] + crowd[row:]
        crowded.append(int(sample(Sampler("cpu", 77), logits, params, step).token_ids[row]))
    assert alone == crowded
    assert len(set(alone)) > 3  # the k-th token uses a fresh draw, not the same one every step

    other_seed = [
        int(sample(Sampler("cpu", 0), target[None], [SamplingParams(top_p=0.95, seed=4321)], step).token_ids[0])
        for step in range(12)
    ]
    assert other_seed != alone


def test_recompute_after_preemption_redraws_the_same_token():
    # A preempted sequence recomputes its prompt and outputs; its next draw is still its k-th.
    logits = torch.randn(1, 500, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(seed=42)]
    first = sample(Sampler("cpu", 0), logits, params, num_generated=7).token_ids
    sampler = Sampler("cpu", 0)
    for _ in range(3):  # the engine generator has moved on meanwhile
        sample(sampler, logits, [SamplingParams()])
    assert torch.equal(sample(sampler, logits, params, num_generated=7).token_ids, first)


def test_seed_mixing_is_splitmix64():
    from ostinato.runner.sampler import _splitmix64

    # The first three outputs of the reference SplitMix64 (Vigna's splitmix64.c) from state 0: each output
    # mixes the state advanced by the golden-ratio increment, which _splitmix64 adds itself.
    golden = 0x9E3779B97F4A7C15
    assert [_splitmix64(k * golden & (2**64 - 1)) for k in range(3)] == [
        0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_draw_seed_accepts_any_int_and_separates_steps():
    seeds = {draw_seed(s, k) for s in (0, 1, -1, 2**63 + 5) for k in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**64 for s in seeds)


def test_unseeded_rows_are_reproducible_per_engine_seed():
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams()] * 8
    a = sample(Sampler("cpu", 11), logits, params).token_ids
    assert torch.equal(a, sample(Sampler("cpu", 11), logits, params).token_ids)
    assert not torch.equal(a, sample(Sampler("cpu", 12), logits, params).token_ids)


def test_unseeded_row_key_mixes_engine_seed_and_seq_id():
    from ostinato.runner.sampler import _signed, _splitmix64

    m = 2**64 - 1
    assert row_key(None, 11, 3) == _signed(_splitmix64(_splitmix64(11) ^ _splitmix64(3)))
    keys = {row_key(None, e, s) for e in (0, 11, -1) for s in (0, 1, 2, 2**40)}
    assert len(keys) == 12 and all(-2**63 <= k < 2**63 for k in keys)  # every row its own stream
    assert row_key(None, -1, 5) == row_key(None, m, 5) and row_key(None, 7, -2) == row_key(None, 7, m - 1)


def test_signed_maps_the_top_half_of_uint64_to_negatives():
    from ostinato.runner.sampler import _signed

    assert _signed(2**63 - 1) == 2**63 - 1 and _signed(2**63) == -2**63 and _signed(m := 2**64 - 1) == -1
    assert _signed(0) == 0 and m > 0


# ---- distributions ------------------------------------------------------------------------------------


def test_unseeded_draws_follow_the_distribution():
    probs = [0.4, 0.3, 0.15, 0.1, 0.05, 0.0]
    counts = draw_counts(probs, SamplingParams(temperature=1.0))
    assert chi_square(counts, probs) < CHI2_999[4]


def test_seeded_draws_follow_the_distribution():
    probs = [0.5, 0.3, 0.2]
    logits = torch.tensor(probs).log()[None]  # [1, V]
    sampler = Sampler("cpu", 0)
    ids = [int(sample(sampler, logits, [SamplingParams(seed=s)], 0).token_ids[0]) for s in range(3000)]
    counts = torch.bincount(torch.tensor(ids), minlength=3).double()
    assert chi_square(counts, probs) < CHI2_999[2]


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    probs = [0.5, 0.3, 0.2]
    scaled = [p ** (1 / temperature) for p in probs]  # softmax(log p / T) ∝ p^(1/T)
    expected = [s / sum(scaled) for s in scaled]
    counts = draw_counts(probs, SamplingParams(temperature=temperature))
    assert chi_square(counts, expected) < CHI2_999[2]


@pytest.mark.parametrize("force_sort_path", [False, True])
def test_top_k_keeps_exactly_k_candidates(force_sort_path):
    vocab, rows = 40, 3000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(6))  # distinct values
    ks = [1, 5, 0]  # 0 = off
    params = [SamplingParams(top_k=k if k else -1, temperature=2.0) for k in ks for _ in range(rows)]
    batch_logits = logits.expand(len(params), -1).contiguous()
    if force_sort_path:  # a top-p row makes the sampler take the sort path for the whole batch
        params.append(SamplingParams(top_p=0.5))
        batch_logits = torch.cat([batch_logits, logits[None]])
    ids = sample(Sampler("cpu", 0), batch_logits, params).token_ids
    order = logits.argsort(descending=True)
    for i, k in enumerate(ks):
        support = set(ids[i * rows : (i + 1) * rows].tolist())
        if k:
            assert support == set(order[:k].tolist())  # every one of the top k, nothing else
        else:
            assert len(support) > 20


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.3, [0]), (0.7, [0, 1]), (0.8, [0, 1, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p, kept):
    probs = [0.5, 0.25, 0.15, 0.1]
    counts = draw_counts(probs, SamplingParams(top_p=top_p), rows=8000)
    mass = sum(probs[i] for i in kept)
    expected = [p / mass if i in kept else 0.0 for i, p in enumerate(probs)]
    dof = len(kept) - 1
    assert chi_square(counts, expected) < (CHI2_999[dof] if dof else 1e-9)  # one token kept: always it


def test_top_p_applies_after_top_k():
    # top-3 renormalized: [0.556, 0.278, 0.167]; the first two already hold 0.833 >= 0.8.
    probs = [0.5, 0.25, 0.15, 0.1]
    counts = draw_counts(probs, SamplingParams(top_k=3, top_p=0.8), rows=6000)
    assert counts[2] == 0 and counts[3] == 0
    assert chi_square(counts, [2 / 3, 1 / 3, 0, 0]) < CHI2_999[1]


# ---- logprobs -----------------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_n_is_sorted():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(7))
    params = [
        SamplingParams(),
        SamplingParams(logprobs=0),
        SamplingParams(temperature=0.5, top_k=2, logprobs=3),  # logprobs ignore temperature and top-k
        SamplingParams(temperature=0.0, logprobs=5),
    ]
    out = sample(Sampler("cpu", 0), logits, params)
    reference = logits.log_softmax(-1)  # [B, V]
    assert torch.allclose(out.logprobs, reference.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_ids.shape == (4, 5)
    assert torch.equal(out.top_ids, reference.argsort(-1, descending=True)[:, :5])
    assert torch.all(out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:])

    host = out.to_host()
    assert host.token_ids == out.token_ids.tolist()
    assert host.logprobs == pytest.approx(out.logprobs.tolist())
    assert [len(ids) for ids in host.top_ids] == [0, 0, 3, 5]  # each request's own N
    assert host.top_ids[2] == out.top_ids[2, :3].tolist()
    assert host.top_logprobs[3] == pytest.approx(out.top_logprobs[3].tolist())
    # The greedy row's token is its most likely one.
    assert host.top_ids[3][0] == host.token_ids[3]
    assert math.isclose(host.top_logprobs[3][0], host.logprobs[3], rel_tol=1e-6)


def test_logprobs_zero_returns_only_the_sampled_logprob():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(9))
    host = sample(Sampler("cpu", 0), logits, [SamplingParams(logprobs=0), SamplingParams()]).to_host()
    assert host.top_ids is None and host.top_logprobs is None
    assert host.logprobs[0] == pytest.approx(float(logits[0].log_softmax(-1)[host.token_ids[0]]))


def test_to_host_without_logprobs():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(8))
    host = sample(Sampler("cpu", 0), logits, [SamplingParams(temperature=0.0)] * 3).to_host()
    assert host.token_ids == logits.argmax(-1).tolist()
    assert host.logprobs is None and host.top_ids is None and host.top_logprobs is None


# ---- GPU ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sampling_never_syncs_and_seeds_reproduce():
    sampler = Sampler("cuda", 0)
    gen = torch.Generator(device="cuda").manual_seed(9)
    logits = torch.randn(6, 32000, device="cuda", generator=gen)
    logits[5] = logits[1]  # rows 1 and 5: same seed, same logits
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=5, top_p=0.9),
              SamplingParams(top_k=20), SamplingParams(top_k=5, top_p=0.8, seed=6),
              SamplingParams(temperature=0.7), SamplingParams(seed=5, top_p=0.9, logprobs=4)]
    sample(sampler, logits, params)  # warm-up: first-use allocations may sync
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sample(sampler, logits, params, num_generated=3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    host = out.to_host()
    assert host.token_ids[0] == int(logits[0].argmax())
    assert host.token_ids[1] == host.token_ids[5]
    alone = sample(Sampler("cuda", 1), logits[1:2], [params[1]], num_generated=3).to_host()
    assert alone.token_ids[0] == host.token_ids[1]
