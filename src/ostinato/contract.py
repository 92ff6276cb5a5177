"""What crosses between the scheduler and the runner, in both directions. Pure Python (no torch).

engine/ (scheduler, engine) and runner/ both import this module and nothing of each other.

A step decodes every running sequence that holds a decode row (one token each: one graph replay) and
prefills chunks of other sequences beside it (eager): kind "decode" (rows only), "prefill" (chunks only),
"mixed" (both) or "idle". The runner keeps the running sequences' decode rows for their whole life
(runner/decode_batch.py), so a step says only what changed since the previous step:
- `left`: sequences whose rows must go (finished, aborted or preempted since the last step);
- `new_blocks`: (seq_id, block) pairs appended to a decode row's block table for this step (a sequence
  crossed a block boundary);
- `seqs`: the prefill chunks. A chunk that reaches its sequence's last token (`samples`) is sampled, and
  the sequence joins the decode batch after the step (a preempted sequence rejoins the same way).
`num_decode` says how many rows decode, as a check.

With speculative decoding there are no decode rows: each decoding sequence is a verify chunk in `seqs`
(ScheduledSeq.verify; engine/speculative.py), so such a step is of kind "prefill".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ostinato.sampling_params import SamplingParams


@dataclass(frozen=True)
class LogitsSpec:
    """A request's logits processors in token ids, as the engine resolved them from its SamplingParams
    (runner/logits_processors.py applies them): the ids min_tokens bans (EOS and stop_token_ids), and
    bad_words as token sequences."""

    params: SamplingParams
    min_tokens_ban: tuple[int, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()

    @property
    def needs_history(self) -> bool:
        """Whether the row needs the sequence's tokens when it joins: penalties count them, a bad word of
        more than one token matches the output's last ones."""
        return self.params.penalized or any(len(w) > 1 for w in self.bad_words)


# A proposed token of --speculative-method draft as the scheduler schedules it: the runner's draft model
# fills it in before the verify forward (runner/draft.py). Not a token id, so an unfilled one fails loudly.
DRAFT_PLACEHOLDER = -1


@dataclass(frozen=True)
class ScheduledSeq:
    """A prefill chunk of one sequence in this step.

    token_ids are the tokens fed (the next chunk of tokens not yet in the cache). start_pos is the position
    of token_ids[0], which equals the number of tokens already cached (earlier chunks, or a prefix found in
    the prefix cache). block_table covers positions [0, start_pos + len(token_ids)). When `samples`, the
    chunk ends at the sequence's last token: the runner samples one token from its logits and the sequence
    joins the decode batch; an earlier chunk only writes K/V.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sampling_params: SamplingParams
    num_generated: int  # tokens generated before this step (the seeded noise's counter)
    samples: bool = True  # the last chunk: sample a token, join the decode batch
    logits_spec: LogitsSpec | None = None  # the request's logits processors, None when it uses none
    # Every token of the sequence (prompt, then its num_generated outputs), on a sampling chunk whose
    # logits_spec needs_history only: what its penalties count.
    history: tuple[int, ...] = ()
    # Speculative decoding: a decode row as a chunk, token_ids = (its last token, then the proposed tokens). All
    # its positions are sampled; the runner returns the tokens up to and including the first that differs
    # from a proposal (engine/speculative.py).
    verify: bool = False
    # --speculative-method draft: the tokens just before token_ids[0] that the draft model has not computed yet
    # (the last accepted proposal when a row accepted all of them), which its first step feeds before the
    # row's last token. The proposals in token_ids are DRAFT_PLACEHOLDER until the runner's draft fills them.
    draft_prefix: tuple[int, ...] = ()

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: what the runner computes and which of its decode rows changed."""

    kind: str  # "prefill" | "decode" | "mixed" | "idle"
    seqs: tuple[ScheduledSeq, ...] = ()  # prefill chunks
    num_decode: int = 0  # every decode row, one token each
    left: tuple[int, ...] = ()  # seq ids whose rows go before this step
    new_blocks: tuple[tuple[int, int], ...] = ()  # (seq_id, block) appended before this step
    preempted_seq_ids: tuple[int, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        return self.num_decode + sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.num_decode


class SampledToken(NamedTuple):
    """One sampled token (a NamedTuple: a decode step makes one per row, and this is the cheapest)."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # the request's top-N alternatives, most likely first


class SpecCounts(NamedTuple):
    """A verify step's speculation: rows that carried proposals, tokens proposed, proposed tokens accepted."""

    rows: int
    proposed: int
    accepted: int


@dataclass(frozen=True)
class StepResult:
    """The runner's answer: one sampled token per decode row (in row order), then one per sampled chunk. A
    verify row (ScheduledSeq.verify) gives its accepted tokens, in order, its seq id once for each."""

    seq_ids: list[int]
    token_ids: list[int]
    tokens: list[SampledToken]  # the same token ids, with logprobs when asked
    spec: SpecCounts | None = None  # a step with verify rows


class DecodeRows:
    """Which row of the persistent decode batch each running sequence holds (the runner's bookkeeping).

    Rows [0, len) are occupied, in join order until a removal: removing a row moves the last row into the
    hole ("condense"), so the occupied rows stay a prefix and one copy of that prefix feeds a step.
    """

    def __init__(self) -> None:
        self.seq_ids: list[int] = []  # row -> seq_id
        self.row_of: dict[int, int] = {}  # seq_id -> row

    def __len__(self) -> int:
        return len(self.seq_ids)

    def add(self, seq_id: int) -> int:
        assert seq_id not in self.row_of, f"seq {seq_id} already holds row {self.row_of[seq_id]}"
        self.row_of[seq_id] = row = len(self.seq_ids)
        self.seq_ids.append(seq_id)
        return row

    def remove(self, seq_id: int) -> tuple[int, int] | None:
        """Free seq_id's row. Returns (hole, last): the row at `last` moved into `hole` (equal when the
        removed row was the last one, then nothing moved); None for a sequence that holds no row."""
        hole = self.row_of.pop(seq_id, None)
        if hole is None:
            return None
        last = len(self.seq_ids) - 1
        moved = self.seq_ids.pop()
        if hole != last:
            self.seq_ids[hole] = moved
            self.row_of[moved] = hole
        return hole, last
