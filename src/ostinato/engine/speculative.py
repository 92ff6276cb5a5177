"""Speculative decoding on the engine side: which tokens each decoding sequence proposes, the KV they may take,
and how a verify step's tokens are taken back. Pure Python (no torch).

A step with speculation is synchronous: the proposals need the tokens of the step before, on the host. Every
decoding sequence becomes a verify row, a chunk (contract.ScheduledSeq with `verify`) of its last token and up
to k proposed tokens at positions n-1 .. n-1+k (n: its tokens so far), fed through the prefill path beside the
step's prompt chunks. The runner samples every position with the sequence's own settings and counters and
returns the tokens up to and including the first that differs from its proposal (runner/spec_verify.py).

KV bookkeeping (SpecScheduler):
- A row takes blocks for its proposals only when the free blocks cover them and still leave one for every
  decoding sequence after it; otherwise it goes without (k = 0), and only then may it preempt, as a plain
  decode does. Speculation never preempts.
- After the step (at the next schedule()), a row's tokens are the accepted ones: the positions computed with
  the right tokens are those before its newest token, which is where the next step starts writing, over the
  slot of the first rejected token. Blocks past the newest token are released (BlockManager.trim). The later
  rejected slots are never read: a query attends only to positions up to its own, all written in its step
  or accepted before.
- The prefix cache keys a block from the sequence's own tokens (accepted only) and only once every position
  in it was computed with them, so no key ever covers a rejected token.

With a draft model (--speculative-method draft) the proposals are placeholders that the runner's draft fills
(runner/draft.py), and the draft keeps a paged KV cache of its own under the same block ids, so every block
the scheduler hands out, trims, frees or keys holds both models' K/V. The draft writes the positions of the
row's last token and of its first k - 1 proposals; when all k were accepted, the last accepted proposal's
position is not in the draft's cache. num_computed_tokens then counts the positions both models hold, one
less than the target's, and the next verify row carries that token as its `draft_prefix`. So a block is keyed
for the prefix cache (and kept across a preemption) only once both caches hold it.
"""

from __future__ import annotations

import logging
from itertools import groupby

from ostinato.config import CacheConfig, SchedulerConfig
from ostinato.contract import DRAFT_PLACEHOLDER, ScheduledSeq, SpecCounts, StepResult
from ostinato.engine.ngram_proposer import NgramProposer
from ostinato.engine.request import Sequence, SequenceStatus
from ostinato.engine.scheduler import Scheduler
from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import SamplingParams
from ostinato.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)


def make_scheduler(config: SchedulerConfig, cache: CacheConfig, speculative: SpeculativeConfig | None) -> Scheduler:
    if speculative is None:
        return Scheduler(config, cache)
    logger.info("speculative decoding: %s; steps are synchronous (no overlapped scheduling)",
                speculative.describe())
    return SpecScheduler(config, cache, speculative)


def check_request(params: SamplingParams) -> None:
    """InvalidRequestError for what a verify step cannot apply: a grammar mask and the logits processors
    depend on the tokens before each position, which for a proposed token are not yet accepted."""
    if params.structured_outputs is not None:
        raise InvalidRequestError("structured outputs are not supported with --speculative-method: drop the "
                                  "constraint, or start the engine without speculative decoding",
                                  param="structured_outputs")
    if params.processes_logits:
        used = [name for name, on in (("repetition_penalty", params.repetition_penalty != 1.0),
                                      ("presence_penalty", params.presence_penalty != 0.0),
                                      ("frequency_penalty", params.frequency_penalty != 0.0),
                                      ("logit_bias", bool(params.logit_bias)), ("min_p", params.min_p > 0.0),
                                      ("min_tokens", params.min_tokens > 0), ("bad_words", bool(params.bad_words)))
                if on]
        raise InvalidRequestError(f"{', '.join(used)} not supported with --speculative-method: leave them at "
                                  "their defaults (a model's generation_config.json may set them: "
                                  "--generation-config vllm ignores it), or start the engine without "
                                  "speculative decoding", param=used[0])


def split_rounds(result: StepResult) -> list[StepResult]:
    """A verify step's tokens (each sequence's run consecutive) as rounds: round j holds the j-th token of every
    sequence that has one. The engine takes them round by round, so a sequence that ends on a token (EOS, a stop
    string, max_tokens) never takes the tokens after it, and the scheduler records exactly those it took."""
    rounds: list[tuple[list, list, list]] = []
    i = 0
    for _, run in groupby(result.seq_ids):
        for j, _ in enumerate(run):
            if j == len(rounds):
                rounds.append(([], [], []))
            ids, toks, sampled = rounds[j]
            ids.append(result.seq_ids[i])
            toks.append(result.token_ids[i])
            sampled.append(result.tokens[i])
            i += 1
    return [StepResult(*r) for r in rounds]


class SpecTotals:
    """The engine's running sums of its verify steps' SpecCounts (EngineStats' spec_decode_* fields)."""

    def __init__(self) -> None:
        self.rows = self.proposed = self.accepted = 0

    def add(self, counts: SpecCounts) -> None:
        self.rows += counts.rows
        self.proposed += counts.proposed
        self.accepted += counts.accepted

    def stats(self) -> dict[str, int]:
        return {"spec_decode_drafts": self.rows, "spec_decode_draft_tokens": self.proposed,
                "spec_decode_accepted_tokens": self.accepted}


class DraftSlots:
    """The draft method's proposals as the scheduler sees them: k placeholders (contract.DRAFT_PLACEHOLDER)
    that the runner's draft model fills, so the scheduler reserves their KV as for prompt lookup."""

    def propose(self, seq: Sequence, k: int) -> tuple[int, ...]:
        return (DRAFT_PLACEHOLDER,) * max(k, 0)

    def forget(self, seq_id: int) -> None:
        """Nothing kept per sequence."""


class SpecScheduler(Scheduler):
    """The scheduler of a speculative engine: its decode rows are verify rows (see the module docstring)."""

    def __init__(self, config: SchedulerConfig, cache: CacheConfig, speculative: SpeculativeConfig):
        super().__init__(config, cache)
        self.speculative = speculative
        self.proposer = DraftSlots() if speculative.uses_draft_model else NgramProposer(
            speculative.prompt_lookup_min, speculative.prompt_lookup_max)
        self._verify: list[ScheduledSeq] = []
        # The last step's verify rows (sequence, its tokens before the step, its proposals), settled at the
        # next schedule().
        self._verifying: list[tuple[Sequence, int, int]] = []

    def _verify_rows(self) -> list[ScheduledSeq]:
        rows, self._verify = self._verify, []
        return rows

    def _remove(self, seq_id: int, status: SequenceStatus) -> bool:
        self.proposer.forget(seq_id)
        return super()._remove(seq_id, status)

    def _schedule_decode(self, preempted: list[int]) -> tuple[int, list[tuple[int, int]]]:
        """Every decoding sequence as a verify row (kept for _verify_rows); no plain decode rows."""
        self._settle_verified()
        bm = self.block_manager
        waiting_rows = sum(1 for s in self._running if s.decoding)
        spare = self.config.max_num_batched_tokens - waiting_rows  # step tokens left for proposals
        i = 0
        while i < len(self._running):
            seq = self._running[i]
            if not seq.decoding:
                i += 1
                continue
            assert not seq.num_inflight, "a speculative step starts from settled tokens"
            waiting_rows -= 1
            n = seq.num_tokens
            proposal = self._proposal(seq, spare)
            extra = bm.blocks_needed(n + len(proposal)) - len(seq.block_table)
            if proposal and extra > bm.num_free_blocks - waiting_rows:
                proposal = ()  # its blocks would leave a later row short: no speculation for it this step
            if proposal:
                grown = bm.ensure_slots(seq, n + len(proposal))
                assert grown
            elif not self._make_room(seq, n, preempted):
                continue  # preempted itself: it left the running list
            spare -= len(proposal)
            self._verify.append(self._verify_chunk(seq, proposal))
            i += 1
        return 0, []

    def _proposal(self, seq: Sequence, spare: int) -> tuple[int, ...]:
        """What seq proposes: at most k tokens, fewer where max_tokens or max_model_len leave less room (a step
        adds at most proposals + 1 tokens), and within the step's token budget."""
        room = min(seq.sampling_params.max_tokens - len(seq.output_token_ids),
                   self.config.max_model_len - seq.num_tokens) - 1
        k = min(self.speculative.num_speculative_tokens, room, spare)
        return self.proposer.propose(seq, k)

    def _verify_chunk(self, seq: Sequence, proposal: tuple[int, ...]) -> ScheduledSeq:
        """The verify row: its last token (position n - 1, not yet in the cache) and the proposals after it.
        Until the step is read, every token it feeds counts in flight. With a draft model, the tokens between
        the positions both models hold and the last token go along as its draft_prefix."""
        n = seq.num_tokens
        chunk = ScheduledSeq(seq_id=seq.seq_id, token_ids=(seq.last_token_id, *proposal), start_pos=n - 1,
                             block_table=tuple(seq.block_table), sampling_params=seq.sampling_params,
                             num_generated=len(seq.output_token_ids), verify=True,
                             draft_prefix=tuple(seq.token_ids_range(seq.num_computed_tokens, n - 1)))
        seq.num_computed_tokens = n
        seq.num_inflight = len(proposal) + 1
        self._verifying.append((seq, n, len(proposal)))
        return chunk

    def _settle_verified(self) -> None:
        """The last step's verify rows, once its tokens were taken (update() per round): the tokens in flight that
        never came were rejected. Their computed positions end before the newest token, the blocks past it go
        back, and the full blocks of accepted tokens are keyed for the prefix cache. A draft model that saw
        every proposal accepted lacks the last one's K/V: the positions both hold end one earlier."""
        bm = self.block_manager
        for seq, before, proposed in self._verifying:
            if self.get(seq.seq_id) is not seq or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted meanwhile: its blocks are free already
            seq.num_inflight = 0
            all_accepted = proposed and seq.num_tokens - before == proposed + 1
            draft_lag = 1 if self.speculative.uses_draft_model and all_accepted else 0
            seq.num_computed_tokens = seq.num_tokens - 1 - draft_lag
            bm.trim(seq, seq.num_tokens)
            bm.commit(seq, seq.num_computed_tokens)
        self._verifying = []
