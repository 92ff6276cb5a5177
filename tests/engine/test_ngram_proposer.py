"""Prompt lookup (engine/ngram_proposer.py) against a plain loop over the token list, and its per-sequence buffer
against lookups of the whole list as the sequence grows."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ostinato.engine.ngram_proposer import NgramProposer, lookup
from ostinato.engine.request import Sequence
from ostinato.sampling_params import SamplingParams


def naive(tokens, k, n_min, n_max):
    for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the most recent earlier occurrence first
            if tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + k])
    return ()


def test_the_largest_n_that_occurs_wins_and_the_latest_occurrence():
    toks = [1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3]
    assert lookup(np.array(toks), 3, 1, 3) == (9, 9, 2)  # the 3-gram 1 2 3 occurs at 0
    assert lookup(np.array(toks), 3, 1, 2) == (7, 8, 1)  # the latest 2 3 is at 5
    assert lookup(np.array([4, 5, 6]), 2, 1, 3) == ()  # nothing repeats
    assert lookup(np.array([5, 5]), 4, 1, 3) == (5,)  # fewer than k tokens follow the match


@settings(max_examples=300, deadline=None)
@given(toks=st.lists(st.integers(0, 3), min_size=1, max_size=40), k=st.integers(1, 6), n_min=st.integers(1, 3),
       extra=st.integers(0, 3))
def test_lookup_matches_a_plain_loop(toks, k, n_min, extra):
    assert lookup(np.array(toks, dtype=np.int64), k, n_min, n_min + extra) == naive(toks, k, n_min, n_min + extra)


def test_the_buffer_follows_the_sequence_as_it_grows():
    rng = np.random.default_rng(0)
    seq = Sequence(0, "r", [int(t) for t in rng.integers(0, 4, 5)], SamplingParams())
    proposer = NgramProposer(1, 3)
    for _ in range(200):  # past the buffer's first sizes: it is regrown several times
        assert proposer.propose(seq, 4) == naive(seq.all_token_ids, 4, 1, 3)
        seq.output_token_ids.extend(int(t) for t in rng.integers(0, 4, int(rng.integers(1, 4))))
    proposer.forget(0)
    assert proposer.propose(seq, 0) == ()
