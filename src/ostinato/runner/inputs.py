"""Turn a step's prefill chunks into the tensors one model step needs (decode rows: runner/decode_batch.py).

Slot arithmetic, written once (`kv_slots`): the token at position p of a sequence lives in block
block_table[p // block_size] at offset p % block_size, i.e. slot = block * block_size + p % block_size. Rows that
pad a decode batch up to a captured graph size use the scratch block (see attention/base.py), so a graph needs
neither masks nor real addresses. `write_prefill_chunks` lays out a step's chunks for both prefill paths: the
eager forward (`build_prefill_inputs`) and the prefill graphs' static buffers (runner/prefill_graphs.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ostinato.attention.base import AttentionMetadata
from ostinato.contract import ScheduledSeq, SchedulerOutput


def kv_slots(tables, positions, block_size: int):
    """The KV slot of each position (int64): block tables[..., position // block_size] at offset
    position % block_size. tables: one block table [W] for positions [q], or one per row [n, W] for positions
    [n]; numpy arrays or torch tensors (then device ops only: capturable)."""
    index = positions // block_size
    if isinstance(tables, torch.Tensor):
        block = (tables.gather(1, index[:, None]).squeeze(1) if tables.ndim == 2 else tables[index]).long()
    else:  # plain indexing: numpy's take_along_axis costs several microseconds more per call
        block = (tables[np.arange(len(index)), index] if tables.ndim == 2 else tables[index]).astype(np.int64,
                                                                                                    copy=False)
    return block * block_size + positions % block_size


@dataclass
class ChunkRows:
    """Where write_prefill_chunks put a step's chunks (chunk after chunk, from its first_row on)."""

    query_starts: list[int]  # [k + 1]: row of each chunk's first token, then the row after the last
    context_lens: list[int]  # [k]
    last_rows: list[int]  # row of the last fed token of each chunk that samples


def write_prefill_chunks(seqs: Sequence[ScheduledSeq], block_size: int, tokens: np.ndarray,
                         first_row: int = 0) -> ChunkRows:
    """Write the chunks' input ids, positions and KV slots into rows 0, 1, 2 of tokens [3, >= first_row + T]
    int64 (T: the chunks' tokens), from column first_row on (a mixed step's decode rows ride before them).
    Both prefill paths lay out their tokens here: the eager forward (build_prefill_inputs) and the prefill
    graphs' static buffers (runner/prefill_graphs.py)."""
    starts, contexts, last_rows = [first_row], [], []
    n = first_row
    for seq in seqs:
        q = len(seq.token_ids)
        pos = np.arange(seq.start_pos, seq.start_pos + q, dtype=np.int64)
        tokens[0, n:n + q] = seq.token_ids
        tokens[1, n:n + q] = pos
        tokens[2, n:n + q] = kv_slots(np.asarray(seq.block_table, dtype=np.int64), pos, block_size)
        n += q
        starts.append(n)
        contexts.append(seq.context_len)
        if seq.samples:  # an earlier chunk of a prompt only writes K/V: no logits for it
            last_rows.append(n - 1)
    return ChunkRows(starts, contexts, last_rows)


@dataclass
class PrefillInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_token_indices: torch.Tensor  # [num_sampled] int64: row of the last fed token of each chunk that samples


def to_device(data, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list or numpy array as a device tensor of `dtype` (the runner's small per-step index tensors use
    it too)."""
    # Pinned host memory lets the copy run asynchronously with respect to the host.
    t = torch.from_numpy(data).to(dtype) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _pad_tables(tables: list[tuple[int, ...]], width: int, fill: int) -> list[list[int]]:
    return [list(t) + [fill] * (width - len(t)) for t in tables]


def build_prefill_inputs(out: SchedulerOutput, block_size: int, scratch_block: int,
                         device: torch.device) -> PrefillInputs:
    """The eager prefill forward's inputs: the step's chunks (write_prefill_chunks) as device tensors."""
    tokens = np.empty((3, sum(len(s.token_ids) for s in out.seqs)), dtype=np.int64)
    chunks = write_prefill_chunks(out.seqs, block_size, tokens)
    query_lens = [len(s.token_ids) for s in out.seqs]
    width = max(len(s.block_table) for s in out.seqs)
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=to_device(tokens[2], torch.int64, device),
        block_tables=to_device(_pad_tables([s.block_table for s in out.seqs], width, scratch_block),
                                torch.int32, device),
        context_lens=to_device(chunks.context_lens, torch.int32, device),
        query_start_loc=to_device(chunks.query_starts, torch.int32, device),
        query_lens=query_lens,
        context_lens_host=chunks.context_lens,
        max_query_len=max(query_lens),
        max_context_len=max(chunks.context_lens),
    )
    return PrefillInputs(
        input_ids=to_device(tokens[0], torch.int64, device),
        positions=to_device(tokens[1], torch.int64, device),
        meta=meta,
        last_token_indices=to_device(chunks.last_rows, torch.int64, device),
    )


def decode_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> AttentionMetadata:
    """Decode metadata from tensors only (no host values), so the same code runs eager and under capture."""
    return AttentionMetadata(is_prefill=False, slot_mapping=slot_mapping, block_tables=block_tables,
                             context_lens=context_lens)
