"""The K/V write into the paged cache: one program per token copies its [num_kv_heads, head_dim] K and V
rows to their slot (layout: attention/base.py). Negative slots are skipped (the vLLM convention for
padding), so a runner may use either a sentinel slot or the scratch block for padded rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.attention_common import check_inputs, kv_to_cache, pad_dim


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_block, stride_cache_tok, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot marks a padded token: nothing to write
        offs_h = tl.arange(0, HEADS_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
        dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_tok
        dst_offs = dst + offs_h[:, None] * stride_cache_head + offs_d[None, :]
        tl.store(k_cache_ptr + dst_offs, kv_to_cache(k, k_cache_ptr), mask=mask)
        tl.store(v_cache_ptr + dst_offs, kv_to_cache(v, v_cache_ptr), mask=mask)


def paged_write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [num_tokens, num_kv_heads, head_dim] -> their slots of k_cache, v_cache
    ([num_blocks, block_size, num_kv_heads, head_dim])."""
    check_inputs(k, k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (num_tokens,)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pad_dim(head_dim), BLOCK_SIZE=k_cache.shape[1],
    )
