"""Continuous-batching scheduler: decodes every step, chunked prefill beside them, prefix caching, preemption.

Pure Python (no torch import). It talks to the runner only through `SchedulerOutput` (ostinato/contract.py):
the runner keeps every decoding sequence's row, so a step reports only what changed since the previous step
(rows that left, block ids appended) plus this step's prefill chunks.

Policy, one `schedule()` call at a time, within a budget of max_num_batched_tokens tokens:

1. Decode first: every running sequence that holds a decode row gets one token (so running decodes are
   never starved, whatever arrives: the step is one CUDA-graph replay plus the chunks below). A sequence
   whose next position starts a new block needs one; when none is free, the most recently admitted running
   sequence is preempted (recompute: its blocks are freed, its full computed blocks staying in the prefix
   cache, and it goes back to the FRONT of the waiting queue, keeping its generated tokens). If that sequence
   is the one asking, it leaves this step instead. The oldest running sequence therefore always makes
   progress: alone, it fits (checked at start-up: num_blocks * block_size >= max_model_len).
2. Then prefill chunks with what is left of the budget (decode rows count one token each; in a step with
   decode rows, at most max_prefill_tokens_while_decoding prompt tokens where that is set): first the
   running sequence still being prefilled (at most one: the newest), as far as the budget and the free
   blocks allow (with no free block at all it waits; the decodes' preemptions above free blocks); then new
   admissions from the head of the waiting queue, in arrival order, while seats
   (max_num_seqs), budget and blocks for the first chunk last. The first that does not fit stops admission
   (no head-of-line skipping). An admitted sequence starts after its cached prefix (the prefix cache's full
   blocks of identical leading tokens; never its last token, whose logits are needed). A chunk that reaches
   the last token is sampled and its sequence holds a decode row from the next step on.
3. Nothing to compute: an "idle" step.

Overlapped scheduling: schedule() may run before the previous step's tokens are read (update()). Each
decoding sequence counts one token in flight meanwhile (num_inflight), so block growth and positions are
planned as if it had landed. A sequence whose token in flight certainly ends it (max_tokens or
max_model_len) is not decoded again: its row leaves at once and it waits, blocks held, for finish(). One
that ends on EOS or a stop string cannot be foreseen and costs one wasted row in the step after. A
sequence preempted with a token in flight rejoins once that token is read.

Known limits:
- Admission reserves blocks only for the first chunk, with no watermark: a sequence admitted into a nearly
  full cache can force a preemption a few steps later.
- Preemption is by recompute only (no swapping to host memory); a preempted sequence pays its prefill
  again, less what the prefix cache still holds of it.
"""

from __future__ import annotations

import logging
from collections import deque

from ostinato.config import CacheConfig, SchedulerConfig
from ostinato.errors import InvalidRequestError, OutOfKVCacheError, QueueFullError
from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.engine.blocks import BlockManager
from ostinato.engine.request import Sequence, SequenceStatus

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the waiting and running queues and the block manager; decides what each step computes.

    Contract with the engine, per step: `out = schedule()`, run the model on `out`, `update(seq_ids,
    sampled_token_ids)` with the runner's StepResult once its tokens are read (overlapped scheduling: after
    the next schedule(); each scheduled sequence counts one token in flight until then), then
    `finish(seq_id, status)` for every sequence the engine decides is done (EOS, stop strings, max_tokens,
    or num_tokens >= max_model_len: the engine must stop a sequence there, the scheduler never grows one
    past max_model_len).
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig):
        self.config = scheduler_config
        self.cache_config = cache_config
        _check_configs(scheduler_config, cache_config)
        self._block_manager = BlockManager(cache_config.num_blocks, cache_config.block_size,
                                           cache_config.enable_prefix_caching, cache_config.prefix_cache_salt)
        self._waiting: deque[Sequence] = deque()  # FCFS; preempted sequences re-enter at the front
        self._running: list[Sequence] = []  # admission order: the last one is preempted first
        self._live: dict[int, Sequence] = {}  # seq_id -> every waiting or running sequence
        self._num_preemptions = 0
        self._left: list[int] = []  # running sequences removed since the last schedule(): their rows go
        # Overlapped scheduling: running sequences whose token in flight certainly ends them (max_tokens,
        # max_model_len). They leave the decode rows at once and wait, blocks held, for the engine's finish().
        self._finishing: dict[int, Sequence] = {}

    # ---- queues ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence at the back of the waiting queue.

        Raises InvalidRequestError for a prompt that can never be served and QueueFullError when
        max_queued_requests sequences are already waiting.
        """
        self.check_prompt_len(len(seq.prompt_token_ids))
        limit = self.config.max_queued_requests
        if limit is not None and len(self._waiting) >= limit:
            raise QueueFullError(
                f"{len(self._waiting)} requests are already waiting (--max-queued-requests {limit}); "
                "retry later or raise --max-queued-requests")
        assert seq.seq_id not in self._live, f"seq_id {seq.seq_id} is already scheduled"
        assert not seq.block_table and seq.num_computed_tokens == 0, "a new sequence holds no KV"
        seq.status = SequenceStatus.WAITING
        self._waiting.append(seq)
        self._live[seq.seq_id] = seq

    def check_prompt_len(self, n: int) -> None:
        """InvalidRequestError unless a prompt of n tokens can ever be scheduled (1 <= n < max_model_len)."""
        max_len = self.config.max_model_len
        if n == 0:
            raise InvalidRequestError("the prompt is empty; send at least one token", param="prompt")
        if n >= max_len:
            raise InvalidRequestError(
                f"the prompt has {n} tokens but max_model_len is {max_len}: shorten the prompt below "
                f"{max_len} tokens (or start the engine with a larger --max-model-len)", param="prompt")

    def abort(self, seq_id: int) -> bool:
        """Drop a waiting or running sequence (FINISHED_ABORTED) and free its blocks.

        Returns False (and does nothing) for an unknown or already finished id.
        """
        return self._remove(seq_id, SequenceStatus.FINISHED_ABORTED)

    def finish(self, seq_id: int, status: SequenceStatus) -> bool:
        """The engine's verdict that a sequence is done: free its blocks and forget it.

        Returns False for an unknown id (e.g. aborted while its step ran).
        """
        assert status.finished, f"finish() needs a FINISHED_* status, got {status}"
        return self._remove(seq_id, status)

    def _remove(self, seq_id: int, status: SequenceStatus) -> bool:
        seq = self._live.pop(seq_id, None)
        if seq is None:
            return False
        if seq.status is SequenceStatus.RUNNING:
            if self._finishing.pop(seq_id, None) is None:
                self._running.remove(seq)
                self._left.append(seq_id)
        else:
            self._waiting.remove(seq)
        self._block_manager.free(seq)
        seq.status = status
        return True

    # ---- the step ----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step (see the module docstring for the policy)."""
        assert all(s.num_inflight for s in self._finishing.values()), \
            "a sequence whose last token was read must be finished (engine: finish() at max_tokens / max_model_len)"
        preempted: list[int] = []
        num_decode, new_blocks = self._schedule_decode(preempted)
        verify = self._verify_rows()  # speculative decoding's decode rows, as chunks (engine/speculative.py)
        budget = self.config.max_num_batched_tokens - num_decode - sum(len(c.token_ids) for c in verify)
        cap = self.config.max_prefill_tokens_while_decoding
        if (num_decode or verify) and cap is not None:
            budget = min(budget, cap)
        chunks = self._continue_prefills(budget)
        budget -= sum(len(c.token_ids) for c in chunks)
        chunks = verify + chunks + self._admit(budget, preempted)
        if not chunks and not num_decode:
            # Nothing computable: only while finishing sequences hold the blocks the others wait for. Otherwise
            # a sequence could never run and waiting for ever would hang the engine.
            assert not (self._waiting or self._running) or self._finishing, "no sequence can ever be scheduled"
            return SchedulerOutput("idle", left=self._take_left(), preempted_seq_ids=tuple(preempted))
        kind = ("mixed" if num_decode else "prefill") if chunks else "decode"
        return SchedulerOutput(kind, tuple(chunks), num_decode, left=self._take_left(),
                               new_blocks=tuple(new_blocks), preempted_seq_ids=tuple(preempted))

    def _verify_rows(self) -> list[ScheduledSeq]:
        """This step's verify rows: none without speculative decoding (SpecScheduler's decode rows)."""
        return []

    def _take_left(self) -> tuple[int, ...]:
        left, self._left = tuple(self._left), []
        return left

    def _continue_prefills(self, budget: int) -> list[ScheduledSeq]:
        """The next chunk of the running sequence still being prefilled, if any, as far as the budget and the
        free blocks allow. There is at most one, the newest: a sequence is admitted only with budget and a block
        to spare, i.e. once the one before it has its last chunk (and a preempted one rejoins as the newest)."""
        seq = self._running[-1] if self._running else None
        if seq is None or seq.decoding or budget <= 0:
            return []
        bm = self._block_manager
        room = bm.room(seq) - seq.num_computed_tokens
        if room <= 0:
            # Not one free block (the decoding sequences took them): it waits, holding its own, until one
            # finishes or, needing a block itself, preempts the newest: this one.
            return []
        n = min(seq.num_tokens - seq.num_computed_tokens, budget, room)
        grown = bm.ensure_slots(seq, seq.num_computed_tokens + n)
        assert grown
        return [self._chunk(seq, n)]

    def _admit(self, budget: int, preempted: list[int]) -> list[ScheduledSeq]:
        chunks: list[ScheduledSeq] = []
        bm, bs = self._block_manager, self._block_manager.block_size
        while self._waiting and budget > 0 and len(self._running) < self.config.max_num_seqs:
            seq = self._waiting[0]
            assert seq.num_tokens < self.config.max_model_len, _past_max_len(seq, self.config.max_model_len)
            if seq.num_inflight or seq.seq_id in preempted:
                break  # preempted with its last token unread, or in this very step: it rejoins at a later step
            hits = bm.cached_prefix(seq)
            cached = len(hits) * bs
            n = min(seq.num_tokens - cached, budget)
            if not bm.can_admit(hits, cached + n):
                break
            self._waiting.popleft()
            bm.admit(seq, hits, cached + n)
            seq.num_computed_tokens = cached
            if seq.num_cached_tokens is None:  # reported for the prompt, not for a recompute
                seq.num_cached_tokens = cached
            seq.status = SequenceStatus.RUNNING
            self._running.append(seq)
            chunks.append(self._chunk(seq, n))
            budget -= n
        return chunks

    def _chunk(self, seq: Sequence, n: int) -> ScheduledSeq:
        """Feed seq's next n uncached tokens (its blocks cover them already); the chunk that reaches the last
        token samples, and the sequence decodes from the next step on."""
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
        samples = end == seq.num_tokens
        spec = seq.logits_spec
        history = tuple(seq.all_token_ids) if samples and spec is not None and spec.needs_history else ()
        chunk = ScheduledSeq(seq_id=seq.seq_id, token_ids=tuple(seq.token_ids_range(start, end)), start_pos=start,
                             block_table=tuple(seq.block_table), sampling_params=seq.sampling_params,
                             num_generated=len(seq.output_token_ids), samples=samples, logits_spec=spec,
                             history=history)
        seq.num_computed_tokens = end
        if samples:  # every token is cached once the step runs, one token in flight
            seq.decoding = True
            seq.num_inflight = 1
        self._block_manager.commit(seq, end)
        return chunk

    def _schedule_decode(self, preempted: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """One token for every decoding sequence. Returns how many decode and the blocks their rows gain."""
        new_blocks: list[tuple[int, int]] = []
        block_size, max_len = self._block_manager.block_size, self.config.max_model_len
        num_decode = 0
        # Oldest first: the victim (the newest) is never one already placed in this step. Per sequence this
        # is O(1) unless it crosses a block boundary (once every block_size steps).
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            if not seq.decoding:  # still being prefilled: chunks come after the decodes
                i += 1
                continue
            # Tokens once the step in flight (if any) lands: num_computed_tokens counts every token fed so far
            # and the last one (sampled, maybe still in flight) is fed now.
            num_tokens = seq.num_computed_tokens + 1
            if seq.num_inflight and self._ends(seq, num_tokens):
                # Its token in flight ends it: computing another would waste a row (and maybe a block).
                self._running.pop(i)
                self._finishing[seq.seq_id] = seq
                self._left.append(seq.seq_id)
                continue
            if num_tokens <= len(seq.block_table) * block_size:
                seq.num_computed_tokens = num_tokens
                seq.num_inflight += 1
                num_decode += 1
                i += 1
                continue
            assert num_tokens < max_len, _past_max_len(seq, max_len)
            assert num_tokens == seq.num_tokens + seq.num_inflight, f"seq {seq.seq_id}: update() was not called"
            held = len(seq.block_table)
            if self._make_room(seq, num_tokens, preempted):  # else seq itself was preempted
                new_blocks.extend((seq.seq_id, b) for b in seq.block_table[held:])
                seq.num_computed_tokens = num_tokens
                seq.num_inflight += 1
                num_decode += 1
                i += 1
        # A victim's blocks were reported only if it had grown earlier in this loop; its row leaves anyway.
        gone = set(preempted)
        return num_decode, [nb for nb in new_blocks if nb[0] not in gone] if gone else new_blocks

    def _make_room(self, seq: Sequence, num_tokens: int, preempted: list[int]) -> bool:
        """Grow seq's blocks to cover num_tokens positions, preempting the newest running sequences while too few
        are free. False when seq itself was the one preempted."""
        while not self._block_manager.ensure_slots(seq, num_tokens):
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, keep the tokens, re-queue at the front."""
        self._running.remove(seq)
        self._block_manager.free(seq)  # its full computed blocks stay cached (prefix caching) for its return
        seq.num_computed_tokens = 0
        seq.decoding = False
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)
        self._left.append(seq.seq_id)
        self._num_preemptions += 1
        if self._num_preemptions == 1:
            logger.warning(
                "KV cache full: preempted sequence %d (it will be recomputed). Frequent preemption slows "
                "serving; give the KV cache more memory (--gpu-memory-utilization, --num-kv-blocks) or "
                "lower --max-num-seqs. Further preemptions are counted in the metrics.", seq.seq_id)
        else:
            logger.debug("preempted sequence %d (%d preemptions in total)", seq.seq_id, self._num_preemptions)

    def _ends(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the token in flight certainly ends seq (max_model_len or max_tokens reached)."""
        return (num_tokens >= self.config.max_model_len
                or len(seq.output_token_ids) + seq.num_inflight >= seq.sampling_params.max_tokens)

    def update(self, seq_ids: list[int], sampled_token_ids: list[int]) -> None:
        """Record a step's tokens: one sampled token per computed sequence (the runner's StepResult).

        A sequence aborted (or finished) while its step ran is skipped; one preempted meanwhile keeps its
        token (its recompute feeds it). Finishing is left to the engine (`finish()`), which knows about EOS
        and stop strings.
        """
        assert len(sampled_token_ids) == len(seq_ids), "one sampled token per computed sequence"
        live = self._live
        for seq_id, token_id in zip(seq_ids, sampled_token_ids):
            seq = live.get(seq_id)
            if seq is None or not seq.num_inflight:
                continue
            seq.output_token_ids.append(token_id)
            seq.num_inflight -= 1

    # ---- introspection -----------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running) + len(self._finishing)

    @property
    def num_prefilling(self) -> int:
        """Running sequences whose prompt (or recompute) is still being prefilled, chunk by chunk (0 or 1)."""
        return sum(1 for s in self._running if not s.decoding)

    @property
    def num_preemptions(self) -> int:
        """Preemptions since start-up (one sequence preempted twice counts twice)."""
        return self._num_preemptions

    @property
    def block_manager(self) -> BlockManager:
        return self._block_manager

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._finishing)

    def get(self, seq_id: int) -> Sequence | None:
        """The waiting or running sequence with this id; None once finished or if unknown."""
        return self._live.get(seq_id)


def _check_configs(sched: SchedulerConfig, cache: CacheConfig) -> None:
    """Refuse a KV cache under which some valid request could never run (SchedulerConfig checks itself)."""
    capacity = cache.num_blocks * cache.block_size
    if capacity < sched.max_model_len:
        fix = (f"lower --max-model-len to {capacity} or less, or " if capacity else "")
        raise OutOfKVCacheError(
            f"the KV cache holds {cache.num_blocks} blocks x {cache.block_size} tokens = {capacity} tokens, "
            f"fewer than max_model_len {sched.max_model_len}, so one sequence at max_model_len could not "
            f"fit: {fix}give the KV cache more memory (--gpu-memory-utilization, --num-kv-blocks)")


def _past_max_len(seq: Sequence, max_model_len: int) -> str:
    return (f"seq {seq.seq_id} has {seq.num_tokens} tokens, max_model_len is {max_model_len}: the engine must "
            "finish a sequence (FINISHED_LENGTH) once num_tokens reaches max_model_len")
