"""What crosses between the scheduler and the runner, in both directions. Pure Python (no torch).

engine/ (scheduler, engine) and runner/ both import this module and nothing of each other.

A step is all-prefill or all-decode (decode steps stay one graph replay). The runner keeps the running
sequences' decode rows for their whole life (runner/decode_batch.py), so a decode step says only what
changed since the previous step:
- `left`: sequences whose rows must go (finished, aborted or preempted since the last step);
- `new_blocks`: (seq_id, block) pairs appended to a block table for this step (a sequence crossed a block
  boundary);
- a prefill step's `seqs` are the sequences that join (a preempted sequence rejoins through a prefill).
Every running sequence decodes in a decode step; `num_decode` says how many that is, as a check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    """A sequence prefilled in this step: it joins the decode batch right after.

    token_ids are the tokens fed (every token not yet in the cache). start_pos is the position of
    token_ids[0], which equals the number of tokens already cached. block_table covers positions
    [0, start_pos + len(token_ids)). The runner samples one token from the logits of the last fed token.
    """

    seq_id: int
    token_ids: tuple[int, ...]
    start_pos: int
    block_table: tuple[int, ...]
    sampling_params: SamplingParams
    num_generated: int  # tokens generated before this step (the seeded noise's counter)

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: what the runner computes and which of its decode rows changed."""

    kind: str  # "prefill" | "decode" | "idle"
    seqs: tuple[ScheduledSeq, ...] = ()  # prefill: the joining sequences
    num_decode: int = 0  # decode: every running sequence, one token each
    left: tuple[int, ...] = ()  # seq ids whose rows go before this step
    new_blocks: tuple[tuple[int, int], ...] = ()  # (seq_id, block) appended before this step
    preempted_seq_ids: tuple[int, ...] = ()

    @property
    def num_batched_tokens(self) -> int:
        if self.kind == "decode":
            return self.num_decode
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.num_decode


class SampledToken(NamedTuple):
    """One sampled token (a NamedTuple: a decode step makes one per row, and this is the cheapest)."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None  # the request's top-N alternatives, most likely first


@dataclass(frozen=True)
class StepResult:
    """The runner's answer: one sampled token per computed sequence, in the runner's row order."""

    seq_ids: list[int]
    token_ids: list[int]
    tokens: list[SampledToken]  # the same token ids, with logprobs when asked


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
