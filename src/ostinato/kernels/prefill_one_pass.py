"""The one-pass varlen causal prefill over the paged KV cache (attention/triton_paged.py runs it when
kernels/prefill_plan.py does not split the key range; the split kernel: kernels/prefill_attention.py).

Grid (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads); a program takes BLOCK_Q new tokens of one
sequence times its GROUP query heads as the rows of one tile, and scans the sequence's cache from
position 0 up to its last query, with the causal mask key_pos <= query_pos where query i of a sequence
with context C and Q new tokens sits at position C - Q + i. So an already-cached prefix (prefix caching,
chunked prefill, recompute after preemption) is read from the cache like any other token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.attention_common import (KERNELS_INTERPRETED, LOG2E, dot, dot_settings, loop_query, pad_dim,
                                               paged_kv_offsets, prefill_shape, rowwise_dot)
from ostinato.kernels.attention_metadata import AttentionMetadata
from ostinato.kernels.prefill_plan import PrefillPlan


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, ROWWISE_DOT: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return  # the grid is sized for the longest query; this sequence is shorter
    context_len = tl.load(context_lens_ptr + seq)
    cached_prefix = context_len - q_len  # new token i sits at position cached_prefix + i

    # Rows are (query, head-in-group) pairs: BLOCK_Q queries x GROUP_PAD heads, query-major.
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # [ROWS] index among this sequence's new tokens
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = cached_prefix + q_idx
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    d_mask = offs_d < HEAD_DIM
    tok_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [ROWS, HEAD_DIM_PAD]
    q = loop_query(q, k_cache_ptr, q_ptr)  # fp16 over an FP8 cache with 16-bit q; K and V widen to q's type

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Keys up to the last query of this block; key 0 is visible to every row, so m_i is finite after one step.
    kv_end = cached_prefix + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    for tok0 in range(0, kv_end, BLOCK_N):
        toks = tok0 + offs_n
        n_mask = toks < kv_end
        kv_offs = paged_kv_offsets(block_tables_ptr, seq * stride_bt, toks, n_mask, kv_head,
                                    stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE)
        k_t = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0).to(q.dtype)  # [HEAD_DIM_PAD, BLOCK_N]
        if ROWWISE_DOT:  # the interpreter: a query's row moves within the tile with the chunking (rowwise_dot)
            s = rowwise_dot(q, k_t) * scale_log2e
        else:
            s = dot(q, k_t, DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [ROWS, BLOCK_N]
        visible = n_mask[None, :] & (toks[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)  # [BLOCK_N, HEAD_DIM_PAD]
        if ROWWISE_DOT:
            acc = acc * alpha[:, None] + rowwise_dot(p.to(v.dtype), v)
        else:
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def paged_prefill_one_pass(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, group: int, plan: PrefillPlan, block_m: int, block_n: int,
                           num_warps: int) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] (head_dim contiguous), sequences back to back per
    meta.query_start_loc -> the same shape. block_m: rows per program (queries x query heads per kv head)."""
    num_tokens, num_heads, head_dim, num_kv_heads, block_size, num_seqs = prefill_shape(q, k_cache, meta)
    block_tables = meta.block_tables  # [num_seqs, W]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, block_m // group_pad)  # rows = block_q * group_pad >= 16
    grid = (triton.cdiv(plan.max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, meta.context_lens, meta.query_start_loc,
        scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=pad_dim(head_dim), BLOCK_SIZE=block_size,
        BLOCK_N=block_n, **dot_settings(q.dtype), ROWWISE_DOT=KERNELS_INTERPRETED, num_warps=num_warps,
    )
    return out
