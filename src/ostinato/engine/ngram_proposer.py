"""Prompt lookup (the `ngram` speculative method): propose the tokens that followed the last earlier occurrence of
a sequence's own last n tokens, in its prompt or its output so far.

Pure Python and numpy (no torch): the scheduler calls it on the host for every decoding sequence, each step. A
sequence's tokens are kept in a numpy buffer that only grows (appended from its token list), so a step costs
one vectorised compare of its windows against the pattern, O(length x n), and no conversion of the whole list.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from ostinato.engine.request import Sequence


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens' last n tokens, for the largest
    n in [n_min, n_max] that occurs earlier; () when none does. The occurrence must be followed by at least one
    token, so the suffix itself never matches."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows that start at 0 .. length - 1 - n: each is followed by at least one token.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tuple(tokens[start: start + k].tolist())
    return ()


class NgramProposer:
    """Proposals for the scheduler's decoding sequences; `forget` a sequence once it leaves for good."""

    def __init__(self, n_min: int, n_max: int):
        self.n_min, self.n_max = n_min, n_max
        self._buffers: dict[int, tuple[np.ndarray, int]] = {}  # seq_id -> (tokens buffer, tokens in it)

    def propose(self, seq: Sequence, k: int) -> tuple[int, ...]:
        """Up to k proposed tokens to follow seq's tokens (prompt, then outputs)."""
        if k <= 0:
            return ()
        return lookup(self._tokens(seq), k, self.n_min, self.n_max)

    def forget(self, seq_id: int) -> None:
        self._buffers.pop(seq_id, None)

    def _tokens(self, seq: Sequence) -> np.ndarray:
        buf, used = self._buffers.get(seq.seq_id, (None, 0))
        total = seq.num_tokens
        if buf is None or used > total:  # new (or, defensively, shorter than recorded: start again)
            buf, used = np.empty(max(64, 2 * total), dtype=np.int64), 0
        elif total > len(buf):
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:used] = buf[:used]
            buf = grown
        if total > used:
            buf[used:total] = seq.token_ids_range(used, total)
        self._buffers[seq.seq_id] = (buf, total)
        return buf[:total]
