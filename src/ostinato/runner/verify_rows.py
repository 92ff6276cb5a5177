"""A verify step's rows as decode rows: each verify chunk of k + 1 tokens flattened into k + 1 packed decode rows
(runner/decode_batch.py's layout), so that the step runs as a decode-graph replay, sampling included.

Row j of a chunk whose first token sits at position s (the sequence's cached context) holds token j at
position s + j, the sequence's block table and its sampling settings with counter num_generated + j. The decode
step unpacks it as every decode row: slot of position s + j, context length s + j + 1. Within a layer every
row's K/V is written before any row attends (the backend's verify_rows setting, runner/backends.py), so row j
reads the cache up to its own token, rows 0 .. j - 1 of this step included: exactly the causal attention of the
prefill path, and a rejected token's slot is only ever read by the rows after it in the same step.

Built with a few numpy calls per step and one Python iteration per sequence (its settings and block table),
none per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from ostinato.contract import ScheduledSeq
from ostinato.runner.sampler import row_key
from ostinato.runner.sampling_state import BLOCKS, CTR, POS, TOKEN, filtered_rows, write_settings


@dataclass(frozen=True)
class VerifyRows:
    """The flattened rows of a step's verify chunks, in logit_rows' order (runner/spec_verify.py)."""

    rows: np.ndarray  # [n, BLOCKS + widest block table] int32
    num_logprobs: list[int | None] | None  # per row, as its request asked; None when none asked
    any_filtered: bool  # some row samples with top-k or top-p (re-drawn after the replay)

    def __len__(self) -> int:
        return len(self.rows)


def num_verify_rows(seqs: tuple[ScheduledSeq, ...]) -> int | None:
    """The decode rows the step's chunks flatten into, or None when some chunk is not a verify row (a prompt
    chunk: it runs the prefill path)."""
    n = 0
    for seq in seqs:
        if not seq.verify:
            return None
        n += len(seq.token_ids)
    return n


def flatten_verify_rows(seqs: tuple[ScheduledSeq, ...], engine_seed: int, scratch_block: int) -> VerifyRows:
    """Every verify chunk's k + 1 tokens as decode rows (the module docstring). Block-table columns past a
    sequence's own blocks hold the scratch block (a decode row reads its table only up to its position)."""
    counts = np.fromiter((len(s.token_ids) for s in seqs), dtype=np.int64, count=len(seqs))
    width = max(len(s.block_table) for s in seqs)
    per_seq = np.full((len(seqs), BLOCKS + width), scratch_block, dtype=np.int32)
    per_seq[:, :BLOCKS] = 0
    for row, seq in zip(per_seq, seqs):
        p = seq.sampling_params
        write_settings(row, p, row_key(p.seed, engine_seed, seq.seq_id), seq.num_generated)
        row[POS] = seq.start_pos
        row[BLOCKS:BLOCKS + len(seq.block_table)] = seq.block_table
    rows = per_seq.repeat(counts, axis=0)
    starts = np.cumsum(counts) - counts
    offset = (np.arange(len(rows)) - starts.repeat(counts)).astype(np.int32)  # j within its chunk
    rows[:, POS] += offset
    rows[:, CTR] += offset
    rows[:, TOKEN] = np.fromiter(chain.from_iterable(s.token_ids for s in seqs), dtype=np.int32, count=len(rows))
    asked = [s.sampling_params.logprobs for s in seqs]
    num_logprobs = None
    if any(k is not None for k in asked):
        num_logprobs = list(chain.from_iterable([k] * len(s.token_ids) for k, s in zip(asked, seqs)))
    return VerifyRows(rows, num_logprobs, bool(filtered_rows(per_seq).any()))
