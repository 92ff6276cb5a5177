"""The matchers of the constrained sequences, and a step's grammar work on them: accepting the tokens the step
sampled, then filling the next step's bitmasks. Both sit on the decode loop's critical path (the masks of step
t+1 wait for the tokens of step t), so they cost as little Python as possible, and are split across a few
persistent threads when the rows' work is large enough to pay for handing it over.

Why not xgrammar's own threads: BatchGrammarMatcher with more than one thread starts a new pool of threads on every
call and joins it at the end, which costs more than filling a whole batch (a fixed ~0.3 ms a step on the H200's
16-core host). xgrammar's calls release the GIL while they work, so chunks of rows (a one-thread batch fill, or
one accept call a row) do run in parallel: the calling thread takes the first chunk, persistent helper threads the
others (RowWork).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

# Helper threads beside the calling one: half the cores as xgrammar's own default, at most four (a step's rows
# rarely hold enough grammar work for more).
HELPER_THREADS = max(1, min(4, (os.cpu_count() or 2) // 2))
# The least work (seconds) worth a chunk of its own: a few times what handing a chunk to a helper and back costs
# (tens of microseconds on an idle host), so that a split pays. A step of JSON rows (a few microseconds each to
# accept or fill) stays in one chunk up to about 64 rows; slower grammars and larger batches split.
MIN_CHUNK_SECONDS = 100e-6
# A split must take at most this share of the one-chunk time, or the work stays in one chunk (a host whose cores
# are busy hands chunks over slowly). Every SPLIT_RETRY calls the other way runs, to measure it again.
SPLIT_MAX_SHARE = 0.8
SPLIT_RETRY = 64


class _Timing:
    """What one kind of work cost lately: seconds per row in one chunk, and a split's time as a share of that."""

    def __init__(self):
        self.row_seconds: float | None = None
        self.split_share = 0.0  # none measured: a split is tried when the work is large enough
        self.calls = 0


class RowWork:
    """Runs `work(lo, hi)` over rows [0, n) in chunks, the first in the calling thread, the others in persistent
    helpers: as many chunks as the measured time per row pays for (at most one per thread), and one chunk when
    splits of that work have not paid lately."""

    def __init__(self, helpers: int = HELPER_THREADS, min_chunk_seconds: float = MIN_CHUNK_SECONDS):
        self.helpers, self.min_chunk_seconds = helpers, min_chunk_seconds
        self._pool: ThreadPoolExecutor | None = None
        self._timings: dict[str, _Timing] = {}

    def timing(self, kind: str) -> _Timing:
        return self._timings.setdefault(kind, _Timing())

    def chunks(self, kind: str, rows: int) -> int:
        most = max(1, min(self.helpers + 1, rows))
        if self.min_chunk_seconds <= 0:  # every thread, whatever the work (tests)
            return most
        t = self.timing(kind)
        if t.row_seconds is None:  # unknown at first: one chunk, which measures it
            return 1
        n = min(most, int(rows * t.row_seconds / self.min_chunk_seconds))
        if n <= 1:
            return 1
        split_pays = t.split_share <= SPLIT_MAX_SHARE
        if t.calls % SPLIT_RETRY == SPLIT_RETRY - 1:
            split_pays = not split_pays
        return n if split_pays else 1

    def run(self, kind: str, rows: int, work: Callable[[int, int], Any]) -> None:
        if rows == 1 or self.helpers == 0:  # nothing to split: no timing either
            work(0, rows)
            return
        chunks, t = self.chunks(kind, rows), self.timing(kind)
        t0 = time.perf_counter()
        if chunks == 1:
            work(0, rows)
        else:
            bounds = [rows * i // chunks for i in range(chunks + 1)]
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.helpers, thread_name_prefix="ostinato-grammar-rows")
            helped = [self._pool.submit(work, lo, hi) for lo, hi in zip(bounds[1:-1], bounds[2:])]
            work(bounds[0], bounds[1])
            for future in helped:
                future.result()
        self._record(t, chunks, rows, time.perf_counter() - t0)

    @staticmethod
    def _record(t: _Timing, chunks: int, rows: int, seconds: float) -> None:
        t.calls += 1
        if t.calls == 1:  # the first call warms up (first touches, lazy set-up): not a measure
            return
        if chunks == 1:
            per_row = seconds / rows
            t.row_seconds = per_row if t.row_seconds is None else 0.8 * t.row_seconds + 0.2 * per_row
        elif t.row_seconds is not None:
            t.split_share = 0.5 * t.split_share + 0.5 * seconds / (rows * t.row_seconds)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class GrammarSet:
    """The matchers of the constrained sequences, and the bitmasks of a step's constrained rows."""

    def __init__(self, vocab_size: int, work: RowWork | None = None):
        self.vocab_size = vocab_size
        self._rows: dict[int, tuple[Any, frozenset[int]]] = {}  # seq_id -> (GrammarMatcher, its grammar's stop ids)
        self._bitmasks: dict[int, Any] = {}  # rows -> a reused int32 bitmask [rows, words]
        self._work = work or RowWork()
        self._local = threading.local()  # each thread's serial BatchGrammarMatcher

    def __bool__(self) -> bool:
        return bool(self._rows)

    def add(self, seq_id: int, compiled) -> None:
        import xgrammar as xgr

        self._rows[seq_id] = (xgr.GrammarMatcher(compiled), frozenset(compiled.tokenizer_info.stop_token_ids))

    def remove(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._rows

    def accept_tokens(self, seq_ids: Sequence[int], token_ids: Sequence[int]) -> set[int]:
        """Advance the matchers of the constrained sequences among seq_ids by their tokens (one step's); returns
        the ids of those that end on it: the grammar is complete (a stop token, which the mask allows only then)
        or refused the token (never, with the mask: the sequence must stop). Their matchers are dropped."""
        rows = self._rows
        picked = [(s, t, rows[s]) for s, t in zip(seq_ids, token_ids) if s in rows]
        if not picked:
            return set()
        accepted: list[bool] = [False] * len(picked)

        def accept(lo: int, hi: int) -> None:  # one call a row: cheaper than xgrammar's batch call and its result
            for i in range(lo, hi):
                _, token_id, (matcher, _) = picked[i]
                accepted[i] = matcher.accept_token(token_id)

        self._work.run("accept", len(picked), accept)
        ended = set()
        for (seq_id, token_id, (_, stop_ids)), ok in zip(picked, accepted):
            if not ok:
                logger.warning("sequence %d: the grammar refused token %d; the sequence stops", seq_id, token_id)
            if not ok or token_id in stop_ids:
                ended.add(seq_id)
                del rows[seq_id]
        return ended

    def fill(self, seq_ids: Sequence[int]):
        """(positions in seq_ids of the constrained rows, their next-token bitmask [k, words] int32 on the CPU),
        or None when none of the rows is constrained. A sequence whose grammar ended (a wasted row) has no
        matcher any more (accept_tokens): its row is left out, its token dropped."""
        rows = self._rows
        positions = [i for i, s in enumerate(seq_ids) if s in rows]
        if not positions:
            return None
        matchers = [rows[seq_ids[i]][0] for i in positions]
        k = len(matchers)
        bitmask = self._bitmask(k)

        def fill_rows(lo: int, hi: int) -> None:
            part = (matchers, bitmask) if hi - lo == k else (matchers[lo:hi], bitmask[lo:hi])
            self._serial().batch_fill_next_token_bitmask(*part)

        self._work.run("fill", k, fill_rows)
        return positions, bitmask

    def _serial(self):
        """This thread's BatchGrammarMatcher of one thread: a plain loop in C++, the GIL released."""
        batch = getattr(self._local, "batch", None)
        if batch is None:
            import xgrammar as xgr

            batch = self._local.batch = xgr.BatchGrammarMatcher(max_threads=1)
        return batch

    def _bitmask(self, rows: int):
        # Power-of-two sizes, sliced: a handful of buffers however the batch changes. Pinned beside a GPU, so
        # that the copy to the device does not wait for the step's forward; two per size in turn, as a step's
        # copy may still be queued while the next step's masks are filled.
        size = 1 << (rows - 1).bit_length()
        bufs = self._bitmasks.get(size)
        if bufs is None:
            import torch
            import xgrammar as xgr

            pin = torch.cuda.is_available()
            bufs = self._bitmasks[size] = [xgr.allocate_token_bitmask(size, self.vocab_size) for _ in range(2)]
            if pin:
                bufs[:] = [b.pin_memory() for b in bufs]
        bufs.reverse()
        return bufs[0][:rows]
