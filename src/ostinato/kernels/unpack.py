"""The decode step's unpacking of its packed rows (DecodeLayout.unpack + resolve_placeholders) as one Triton kernel.

Why: in torch the unpacking is about 14 tiny kernels at the head of every decode graph (casts, a gather of the
block id, the slot arithmetic, the placeholder lookup), ~1.5 us each in a replay: a few percent of a small model's
step at batch 1. One program per 128 rows does all of it.

Outputs, for rows [0, n): input ids (int64; a placeholder -(r + 1) resolved to sampled[r]), positions (int64),
slot mapping (int64: block_table[position // block_size] * block_size + position % block_size, the formula of
kv_slots in runner/inputs.py) and context lengths (int32: position + 1). The block table stays a view of the rows.
"""

from __future__ import annotations

import torch

from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)

_ROWS_PER_PROGRAM = 128


@_jit
def _unpack_kernel(rows_ptr, stride_r, sampled_ptr, ids_ptr, pos_ptr, slot_ptr, ctx_ptr, n, block_size,
                   TOKEN: tl.constexpr, POS: tl.constexpr, BLOCKS: tl.constexpr, ROWS: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    mask = r < n
    row = rows_ptr + r.to(tl.int64) * stride_r
    token = tl.load(row + TOKEN, mask=mask, other=0)
    pos = tl.load(row + POS, mask=mask, other=0)
    placeholder = mask & (token < 0)
    previous = tl.load(sampled_ptr + tl.maximum(-token - 1, 0), mask=placeholder, other=0)
    block = tl.load(row + BLOCKS + pos // block_size, mask=mask, other=0)
    tl.store(ids_ptr + r, tl.where(placeholder, previous, token.to(tl.int64)), mask=mask)
    tl.store(pos_ptr + r, pos.to(tl.int64), mask=mask)
    tl.store(slot_ptr + r, block.to(tl.int64) * block_size + pos % block_size, mask=mask)
    tl.store(ctx_ptr + r, pos + 1, mask=mask)


def available_for(rows: torch.Tensor) -> bool:
    return triton is not None and rows.is_cuda


def unpack(rows: torch.Tensor, sampled: torch.Tensor, block_size: int, token: int, pos: int, blocks: int,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows [n, width] int32 (last dim contiguous), sampled [>= rows] int64 -> (input_ids, positions,
    slot_mapping, context_lens), the first three int64 [n], the last int32 [n]."""
    n = rows.shape[0]
    assert rows.dtype == torch.int32 and rows.stride(-1) == 1 and sampled.dtype == torch.int64
    ids, positions, slots = (torch.empty(n, dtype=torch.int64, device=rows.device) for _ in range(3))
    context_lens = torch.empty(n, dtype=torch.int32, device=rows.device)
    if n:
        _unpack_kernel[(triton.cdiv(n, _ROWS_PER_PROGRAM),)](
            rows, rows.stride(0), sampled, ids, positions, slots, context_lens, n, block_size,
            TOKEN=token, POS=pos, BLOCKS=blocks, ROWS=_ROWS_PER_PROGRAM, num_warps=4)
    return ids, positions, slots, context_lens
