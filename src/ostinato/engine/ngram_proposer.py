"""Prompt lookup (the `ngram` speculative method): propose the tokens that followed the last earlier occurrence of
a sequence's own last n tokens, in its prompt or its output so far.

Pure Python and numpy (no torch): the scheduler calls it on the host for every decoding sequence, each step. A
sequence's tokens are kept in a numpy buffer that only grows (appended from its token list), so a step costs
one vectorised compare over it (`lookup`) and no conversion of the whole list.
"""

from __future__ import annotations

import numpy as np

from ostinato.engine.request import Sequence


def lookup(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> tuple[int, ...]:
    """Up to k tokens that followed the most recent earlier occurrence of tokens' last n tokens, for the largest
    n in [n_min, n_max] that occurs earlier; () when none does. The occurrence must be followed by at least one
    token, so the suffix itself never matches.

    One compare over the whole sequence finds where its last token occurred before (each a candidate end of a
    match); longer n-grams only check those candidates' preceding tokens, so a step costs O(length + matches x
    n), not O(length x n)."""
    length = len(tokens)
    if length < 2:
        return ()
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # followed by at least one token
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        cand = ends[ends >= n - 1]
        for d in range(1, n):
            if not cand.size:
                break
            cand = cand[tokens[cand - d] == tokens[length - 1 - d]]
        if cand.size:
            start = int(cand[-1]) + 1
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
