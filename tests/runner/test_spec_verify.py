"""The verify step's draw and acceptance (runner/spec_verify.py) without a model: which logit rows are sampled,
which draws are kept, and, over many seeded draws, that the kept tokens follow the target's distribution
(rejection sampling with a one-hot draft), checked by a chi-square test."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from ostinato.contract import ScheduledSeq
from ostinato.runner.sampling_state import BLOCKS, CTR, write_settings
from ostinato.runner.sampler import row_key
from ostinato.runner.spec_verify import SpecVerifier, accept, logit_rows, sampled_hidden
from ostinato.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0)


def verify_row(seq_id, tokens, params=GREEDY, num_generated=0):
    return ScheduledSeq(seq_id, tuple(tokens), 10, (0, 1), params, num_generated, verify=True)


def prompt_chunk(seq_id, tokens, samples=True):
    return ScheduledSeq(seq_id, tuple(tokens), 0, (2,), GREEDY, 0, samples=samples)


def test_logit_rows_are_every_verify_position_and_each_sampling_chunks_last():
    seqs = (verify_row(0, [5, 6, 7]), prompt_chunk(1, [1, 2, 3, 4], samples=False), prompt_chunk(2, [8, 9]),
            verify_row(3, [4]))
    rows, sampled = logit_rows(seqs)
    assert rows == [0, 1, 2, 8, 9]
    assert [s.seq_id for s in sampled] == [0, 2, 3]


@pytest.mark.parametrize("drawn, kept, accepted", [
    ([6, 7, 9], [0, 1, 2], 2),  # every proposal matched: the last draw is the bonus token
    ([6, 1, 9], [0, 1], 1),  # the second proposal differs: the draw there is the row's correction
    ([2, 7, 9], [0], 0),  # the first differs: one token, as a plain decode step gives
])
def test_a_verify_row_keeps_its_draws_up_to_the_first_that_differs(drawn, kept, accepted):
    seqs = [verify_row(4, [5, 6, 7]), prompt_chunk(1, [1, 2])]
    idx, ids, counts = accept(seqs, drawn + [3])
    assert idx == kept + [3] and ids == [4] * len(kept) + [1]
    assert counts == (1, 2, accepted)


@pytest.mark.parametrize("seqs, expected", [
    ((verify_row(0, [5, 6]), verify_row(1, [7, 8, 9])), [0, 1, 2, 3, 4]),  # verify rows only: every row, a view
    ((verify_row(0, [5, 6]), prompt_chunk(1, [1, 2, 3])), [0, 1, 4]),  # a prompt chunk samples its last row only
    ((prompt_chunk(1, [1, 2], samples=False), verify_row(0, [5])), [2]),  # the rows start after a non-sampler
])
def test_the_sampled_hidden_states_are_the_logit_rows(seqs, expected):
    hidden = torch.arange(6 * 3, dtype=torch.float32).view(6, 3)
    rows, _ = logit_rows(seqs)
    picked = sampled_hidden(hidden, rows, torch.device("cpu"))
    assert torch.equal(picked, hidden[expected])
    assert (picked.data_ptr() == hidden.data_ptr()) == (expected == list(range(len(expected))))


def test_settings_give_every_position_its_chunks_row_and_its_own_counter():
    verifier = SpecVerifier(None, None, 16, 0, torch.device("cpu"), engine_seed=3)
    sampled = SamplingParams(temperature=0.7, top_k=5, seed=9, logprobs=2)
    seqs = [verify_row(4, [1, 2, 3], sampled, num_generated=6), prompt_chunk(2, [7, 8]), verify_row(5, [1, 2])]
    batch = verifier.settings(seqs)
    expected = np.zeros((6, BLOCKS), dtype=np.int32)
    for r, (seq, j) in enumerate([(seqs[0], 0), (seqs[0], 1), (seqs[0], 2), (seqs[1], 0), (seqs[2], 0),
                                  (seqs[2], 1)]):
        p = seq.sampling_params
        write_settings(expected[r], p, row_key(p.seed, 3, seq.seq_id), seq.num_generated + j)
    assert np.array_equal(batch.rows.numpy(), expected)
    assert batch.rows[:, CTR].tolist() == [6, 7, 8, 0, 0, 1]
    assert batch.any_filtered and batch.num_logprobs == (2, 2, 2, None, None, None)


def test_a_row_without_proposals_is_one_draw_and_no_draft():
    idx, ids, counts = accept([verify_row(0, [5])], [9])
    assert (idx, ids, counts) == ([0], [0], (0, 0, 0))


def test_positions_draw_with_the_counters_a_plain_decode_would():
    """Position j of a row draws as the row's (num_generated + j)-th draw: the same token a seeded request gets
    at that output index from a row holding that counter."""
    verifier = SpecVerifier(None, None, 16, 0, torch.device("cpu"), engine_seed=0)
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(1, 50).repeat(4, 1)
    drawn = verifier.draw(logits, [verify_row(0, [1, 2, 3, 4], params, num_generated=7)]).token_ids
    alone = [verifier.draw(logits[:1], [verify_row(0, [1], params, num_generated=7 + j)]).token_ids[0]
             for j in range(4)]
    assert drawn == alone
    assert len(set(drawn)) > 1  # distinct counters draw distinct noise (else the check above proves little)


def test_kept_tokens_follow_the_target_distribution_chi_square():
    """Rejection sampling with a one-hot draft: over 4000 seeds, the first kept token follows the target at
    position 0 and, where the proposal there was accepted, the second follows the target at position 1. The
    draws are seeded (deterministic); the test fails below a p-value of 1e-3 for either."""
    vocab, seeds = 6, 4000
    p0 = torch.tensor([0.05, 0.45, 0.2, 0.1, 0.15, 0.05])
    p1 = torch.tensor([0.3, 0.05, 0.05, 0.4, 0.1, 0.1])
    logits = torch.stack([p0.log(), p1.log(), torch.zeros(vocab)])  # the last row: the bonus position
    verifier = SpecVerifier(None, None, 16, 0, torch.device("cpu"), engine_seed=0)
    proposals = (1, 3)  # likely ones: most rows accept, some reject at each position
    seqs = [verify_row(s, (7,) + proposals, SamplingParams(temperature=1.0, seed=s), num_generated=3)
            for s in range(seeds)]
    drawn = verifier.draw(logits.repeat(seeds, 1), seqs).token_ids
    idx, ids, _ = accept(seqs, drawn)
    kept: dict[int, list[int]] = {}
    for i, sid in zip(idx, ids):
        kept.setdefault(sid, []).append(drawn[i])
    first = np.bincount([k[0] for k in kept.values()], minlength=vocab)
    second = np.bincount([k[1] for k in kept.values() if k[0] == proposals[0]], minlength=vocab)
    for counts, p in ((first, p0), (second, p1)):
        expected = p.double().numpy() / p.double().sum().item() * counts.sum()
        assert chisquare(counts, expected).pvalue > 1e-3, (counts, expected)
    # Both outcomes occur at position 0: accepted and rejected rows were drawn.
    assert 0.3 < first[proposals[0]] / seeds < 0.6


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=4)],
                         ids=["temperature", "top-k"])
def test_draft_proposals_keep_the_target_distribution_chi_square(params):
    """Rejection sampling with a draft's real distribution q: each row proposes a token drawn from q (the
    draft's own draw, runner/draft.py), the verify step accepts it with min(1, p/q) or draws from
    max(0, p - q). Over 6000 seeds the kept token at position 0 follows p under the row's settings (the test
    fails below a p-value of 1e-3), and the acceptance rate is the overlap sum(min(p, q)) within 0.03."""
    from ostinato.contract import DRAFT_PLACEHOLDER
    from ostinato.runner.draft import draw_proposals

    vocab, seeds = 6, 6000
    target = torch.tensor([0.05, 0.35, 0.2, 0.1, 0.25, 0.05]).log()
    draft = torch.tensor([0.3, 0.1, 0.3, 0.05, 0.05, 0.2]).log()  # far from the target: many rejections
    verifier = SpecVerifier(None, None, 16, 0, torch.device("cpu"), engine_seed=0)
    seqs = [verify_row(s, (7, DRAFT_PLACEHOLDER), SamplingParams(seed=s, **params), num_generated=3)
            for s in range(seeds)]
    proposals, q = draw_proposals(seqs, draft.repeat(seeds, 1), 0, True, 0, torch.device("cpu"))
    seqs = [verify_row(s.seq_id, (7, x), s.sampling_params, num_generated=3) for s, x in zip(seqs, proposals)]
    logits = torch.stack([target, torch.zeros(vocab)])  # the second row: the bonus position
    drawn = verifier.draw(logits.repeat(seeds, 1), seqs, q).token_ids
    first = np.bincount(drawn[0::2], minlength=vocab)

    def settled(logits):  # the row's distribution by hand: temperature, then top-k
        z = logits / params["temperature"]
        if "top_k" in params:
            z = torch.where(z >= z.topk(params["top_k"]).values[-1], z, torch.tensor(float("-inf")))
        return z.softmax(-1).double()

    p, q_want = settled(target), settled(draft)
    assert torch.allclose(q[0].double(), q_want, atol=1e-6)
    expected = (p / p.sum() * seeds).numpy()
    support = expected > 0  # top-k leaves tokens out: none of them may be drawn
    assert first[~support].sum() == 0
    assert chisquare(first[support], expected[support]).pvalue > 1e-3, (first, expected)
    accepted = np.mean([d == x for d, x in zip(drawn[0::2], proposals)])
    assert accepted == pytest.approx(torch.minimum(p, q_want).sum().item(), abs=0.03)
