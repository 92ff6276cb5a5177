"""The per-step attention inputs every attention kernel and backend reads (layout: attention/base.py).

It lives with the kernels, at the bottom of the layers, so that the kernels need nothing above them;
attention/base.py re-exports it for the backends and their callers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, all on the model's device.

    slot_mapping[i] = block * block_size + offset where token i's K/V is written.  # [num_tokens] int64
    block_tables[s, j] = the j-th block of sequence s; unused entries hold scratch_block.  # [num_seqs, W] int32
    context_lens[s] = tokens of sequence s in the cache after this step's writes.  # [num_seqs] int32
    Prefill only (prefill runs eager, so host-side ints are allowed there):
    query_start_loc: cumulative new-token counts.  # [num_seqs + 1] int32
    query_lens / context_lens_host: the same figures as Python lists.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None = None
    query_lens: list[int] | None = None
    context_lens_host: list[int] | None = None
    max_query_len: int = 1
    max_context_len: int = 0
    # A mixed step (prefill only): its first decode_rows.context_lens.shape[0] token rows may be decode rows,
    # one token each, attended by decode() with this metadata (its slot_mapping unused: every token's K/V is
    # written once, by the step's slot_mapping); a row whose context_lens entry is 0 is none (the prefill
    # sequences own it). See AttentionBackend.attend.
    decode_rows: "AttentionMetadata | None" = None
