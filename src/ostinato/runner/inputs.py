"""Turn a prefill SchedulerOutput into the tensors one model step needs (decode rows: runner/decode_batch.py).

Slot arithmetic: token at position p of a sequence lives in block block_table[p // block_size] at offset
p % block_size, i.e. slot = block * block_size + p % block_size. Rows that pad a decode batch up to a captured
graph size use the scratch block (see attention/base.py), so a graph needs neither masks nor real addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.attention.base import AttentionMetadata
from ostinato.contract import SchedulerOutput


@dataclass
class PrefillInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_token_indices: torch.Tensor  # [num_sampled] int64: row of the last fed token of each chunk that samples


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor of `dtype` (the runner's small per-step index tensors use it too)."""
    # Pinned host memory lets the copy run asynchronously with respect to the host.
    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _pad_tables(tables: list[tuple[int, ...]], width: int, fill: int) -> list[list[int]]:
    return [list(t) + [fill] * (width - len(t)) for t in tables]


def build_prefill_inputs(out: SchedulerOutput, block_size: int, scratch_block: int,
                         device: torch.device) -> PrefillInputs:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    last_rows: list[int] = []
    for s in out.seqs:
        for i, tok in enumerate(s.token_ids):
            pos = s.start_pos + i
            input_ids.append(tok)
            positions.append(pos)
            slots.append(s.block_table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(len(s.token_ids))
        context_lens.append(s.context_len)
        if s.samples:  # an earlier chunk of a prompt only writes K/V: no logits for it
            last_rows.append(len(input_ids) - 1)
    width = max(len(s.block_table) for s in out.seqs)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        is_prefill=True,
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(_pad_tables([s.block_table for s in out.seqs], width, scratch_block),
                                torch.int32, device),
        context_lens=to_device(context_lens, torch.int32, device),
        query_start_loc=to_device(starts, torch.int32, device),
        query_lens=query_lens,
        context_lens_host=context_lens,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
    )
    return PrefillInputs(
        input_ids=to_device(input_ids, torch.int64, device),
        positions=to_device(positions, torch.int64, device),
        meta=meta,
        last_token_indices=to_device(last_rows, torch.int64, device),
    )


def decode_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> AttentionMetadata:
    """Decode metadata from tensors only (no host values), so the same code runs eager and under capture."""
    return AttentionMetadata(is_prefill=False, slot_mapping=slot_mapping, block_tables=block_tables,
                             context_lens=context_lens)
