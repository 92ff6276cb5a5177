"""Prefill attention split over the key range (flash-decoding for prefill), in Triton.

Why: a chunked prefill step attends a short chunk (tens to hundreds of new tokens) over a long cached
context. The one-pass kernel in kernels/prefill_one_pass.py gives each (query block, sequence, kv head) one
program that scans every key serially: a 96-token chunk over 8000 cached tokens of the llama-3.1-8b shape
is 6 x 8 = 48 programs on 132 SMs, 330 µs per layer (~38 TFLOP/s), which stalls the decodes beside it.
Here each of those programs' key range is cut into `splits` slices, one program each, and a small reduce
kernel merges the slices' partial (max, sum, output).

Layout: attention/base.py (k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]).

Algorithm
    split     grid (num_tokens // BLOCK_Q + num_seqs, num_kv_heads, splits). Axis 0 enumerates the query
              blocks of all sequences back to back: sequence s owns blocks from query_start_loc[s] //
              BLOCK_Q + s on, which leaves room for its cdiv(q_len, BLOCK_Q) blocks whatever the lengths,
              so the grid depends on shapes only; a program finds its sequence by a binary search over
              query_start_loc, and one past the sequence's blocks returns at once (as does one before
              query_start_loc[0], which a mixed step's decode rows make > 0: AttentionBackend.attend). Its rows are
              BLOCK_Q new tokens x the GROUP query heads of one kv head (query-major), as in the one-pass
              kernel. The block's keys 0 .. kv_end - 1 (kv_end: one past its last query's position; new
              token i of a sequence with context C and Q new tokens sits at C - Q + i) are cut into
              `splits` slices of cdiv(kv_end, splits) keys rounded up to BLOCK_N, so the slice length is
              data (read in the kernel) and the split count is the only thing the launch fixes. A slice past
              kv_end is empty: its program marks its partial max -inf and returns. Tiles below the block's
              first query position are visible to every row and skip the causal mask; only the last
              tiles, which cross the diagonal, apply it (a row may see no key of its slice there: its
              partial is max -inf, sum 0, output 0).
    reduce    grid (num_tokens, head groups): weights each slice's output by exp2(max_s - max) and divides by
              the weighted sum; slices with max -inf count zero. Tokens past query_start_loc[num_seqs] (the
              padding of a prefill captured at a fixed token count) are left unwritten, as the one-pass
              kernel leaves them. With splits == 1 the split kernel normalises and writes the output
              itself (no reduce), which the measuring script uses to compare this kernel unsplit with the
              one-pass kernel.
    compiles  one variant of each kernel per model and tuning: BLOCK_Q is fixed by block_m and the group
              (not by the chunk's length), the reduce pads every split count to one power of two, and the
              run-time counts (sequences, splits) and the block table's width are not specialised. So one
              warm-up step that splits (runner/warmup.py) compiles them before serving.

When to split, and how many ways: kernels/prefill_plan.py (host side only).

Limits: as attention/triton_paged.py (any head_dim, padded; any block_size; fp32/bf16/fp16; GQA by
num_heads // num_kv_heads). Partials take num_tokens * num_heads * splits * (head_dim_pad + 2) fp32.
Launch settings (PrefillSplitTuning) are not benchmark-tuned yet (benchmarks/kernels/prefill_attention.py --sweep
measures the alternatives). Compiled ahead of time for sm_90 (triton 3.9, strides divisible by 16 as the
launcher specialises them, registers read back with cuobjdump -res-usage), the defaults use ~190 registers and
no spills for bf16/fp16 at head_dim 64/128, GQA 1-8, with wgmma dots and cp.async-pipelined K/V loads; fp32
spills (as the one-pass kernel does: fp32 is the correctness path). The split kernel computes its partials'
addresses only after the key loops: kept live across them, they spilled ~300 bytes a thread.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels.attention_metadata import AttentionMetadata
from ostinato.kernels.device import num_sms
from ostinato.kernels.prefill_plan import PrefillPlan, PrefillSplitTuning, plan_prefill
from ostinato.kernels.attention_common import (LOG2E, dot, dot_settings, loop_query, pad_dim, paged_kv_offsets,
                                               prefill_shape)

_REDUCE_TILE = 4096  # fp32 partial-output values per reduce program (32 registers a thread at 4 warps)


@triton.jit
def _sequence_of_block(query_start_loc_ptr, block_id, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks include flattened block `block_id`: the last s with start(s) <=
    block_id, start(s) = query_start_loc[s] // BLOCK_Q + s (strictly increasing; s = 0 for a block before
    start(0), which the caller skips). A binary
    search with a run-time bound, so no sequence count compiles a variant of its own."""
    lo = block_id * 0  # a loop-carried value must be a tensor from the start
    hi = lo + num_seqs  # invariant: start(lo) <= block_id, and hi == num_seqs or start(hi) > block_id
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go_right = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= block_id
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    return lo


@triton.jit
def _attend_tile(acc, m_i, l_i, q, tok0, end, q_pos, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_row,
                 kv_head, scale_log2e, stride_cache_block, stride_cache_tok, stride_cache_head,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 UPCAST_DOT: tl.constexpr):
    """One online-softmax step over keys tok0 .. tok0 + BLOCK_N - 1 (those below `end`). CAUSAL applies
    key_pos <= q_pos; without it every row must see every key of the tile."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    toks = tok0 + offs_n
    n_mask = toks < end
    if HEAD_DIM == HEAD_DIM_PAD:
        kv_mask = n_mask[:, None]  # no padded columns: a row mask keeps the loads 16 bytes wide
    else:
        kv_mask = n_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    kv_offs = paged_kv_offsets(block_tables_ptr, seq_row, toks, n_mask, kv_head,
                               stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE)
    tile = kv_offs[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    k = tl.load(k_cache_ptr + tile, mask=kv_mask, other=0.0).to(q.dtype)  # an FP8 cache widens to q's dtype
    v = tl.load(v_cache_ptr + tile, mask=kv_mask, other=0.0).to(q.dtype)
    s = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [ROWS, BLOCK_N]
    if CAUSAL:
        s = tl.where(n_mask[None, :] & (toks[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if CAUSAL:
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key: keep 0, not NaN
    else:
        m_base = m_new
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - m_base[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return acc, m_new, l_i


# Run-time counts and the block table's width (the step's longest sequence) are not specialised: a value of
# 1 or a multiple of 16 would compile a variant of its own inside a user's step. The constexprs depend on
# the model and the tuning only.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "stride_bt"])
def _prefill_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    scale_log2e, num_seqs, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # num_splits is a run-time argument (one compiled kernel for every split count); SPLIT = num_splits > 1.
    block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _sequence_of_block(query_start_loc_ptr, block_id, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = block_id - (q_start // BLOCK_Q + seq)
    if q_block < 0 or q_block * BLOCK_Q >= q_len:
        # A spare block of the grid (sequence s has at most one more than cdiv(q_len, BLOCK_Q)), or one
        # before the first sequence's rows (a mixed step's decode rows come first: query_start_loc[0] > 0).
        return
    cached_prefix = tl.load(context_lens_ptr + seq) - q_len  # new token i sits at position cached_prefix + i

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)  # (query, head-in-group) pairs, query-major
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD  # index among this sequence's new tokens
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = cached_prefix + q_idx
    tok_rows = (q_start + q_idx).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    kv_end = cached_prefix + tl.minimum((q_block + 1) * BLOCK_Q, q_len)  # one past the block's last query
    span = tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N) * BLOCK_N  # >= BLOCK_N: kv_end >= 1 here
    start = split * span
    if SPLIT:
        if start >= kv_end:
            part_idx = (tok_rows * NUM_HEADS + heads) * num_splits + split  # [ROWS] into [tokens, heads, splits]
            tl.store(part_max_ptr + part_idx, float("-inf"), mask=row_mask)  # the reduce skips this slice
            return
    end = tl.minimum(start + span, kv_end)
    # Keys at or below the block's first query position are visible to every row: no mask before `diagonal`
    # (start is a multiple of BLOCK_N, so the unmasked tiles are whole tiles).
    diagonal = cached_prefix + q_block * BLOCK_Q + 1
    unmasked_end = start + tl.maximum(tl.minimum(end, diagonal) - start, 0) // BLOCK_N * BLOCK_N

    q = tl.load(q_ptr + tok_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [ROWS, HEAD_DIM_PAD]
    q = loop_query(q, k_cache_ptr, q_ptr)  # fp16 over an FP8 cache with 16-bit q; K and V widen to q's type
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    seq_row = seq.to(tl.int64) * stride_bt
    for tok0 in range(start, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, tok0, end, q_pos, k_cache_ptr, v_cache_ptr,
                                     block_tables_ptr, seq_row, kv_head, scale_log2e, stride_cache_block,
                                     stride_cache_tok, stride_cache_head, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE,
                                     BLOCK_N, False, DOT_PRECISION, UPCAST_DOT)
    for tok0 in range(unmasked_end, end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, tok0, end, q_pos, k_cache_ptr, v_cache_ptr,
                                     block_tables_ptr, seq_row, kv_head, scale_log2e, stride_cache_block,
                                     stride_cache_tok, stride_cache_head, HEAD_DIM, HEAD_DIM_PAD, BLOCK_SIZE,
                                     BLOCK_N, True, DOT_PRECISION, UPCAST_DOT)

    if SPLIT:
        part_idx = (tok_rows * NUM_HEADS + heads) * num_splits + split
        tl.store(part_max_ptr + part_idx, m_i, mask=row_mask)
        tl.store(part_sum_ptr + part_idx, l_i, mask=row_mask)
        tl.store(part_out_ptr + part_idx[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_mask[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _prefill_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr, num_seqs, num_splits,
    stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if token >= tl.load(query_start_loc_ptr + num_seqs) or token < tl.load(query_start_loc_ptr):
        return  # padding past the last sequence (a captured token count), or a mixed step's decode row
    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = heads < NUM_HEADS
    idx = (token * NUM_HEADS + heads[:, None]) * num_splits + offs_s[None, :]  # [HEADS, SPLITS]
    m_s = tl.load(part_max_ptr + idx, mask=h_mask[:, None] & (offs_s < num_splits)[None, :], other=float("-inf"))
    live = m_s > float("-inf")  # empty slices wrote only their max: never read their sum or output
    l_s = tl.load(part_sum_ptr + idx, mask=live, other=0.0)
    o_s = tl.load(part_out_ptr + idx[:, :, None] * HEAD_DIM_PAD + offs_d[None, None, :],
                  mask=live[:, :, None], other=0.0)  # [HEADS, SPLITS, HEAD_DIM_PAD]
    m_max = tl.max(m_s, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a padded head: every weight 0, not NaN
    w = tl.where(live, tl.exp2(m_s - m_max[:, None]), 0.0)
    total = tl.sum(l_s * w, 1)
    out = tl.sum(o_s * w[:, :, None], 1) / tl.where(total == 0.0, 1.0, total)[:, None]  # [HEADS, HEAD_DIM_PAD]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :])


def plan_for(tuning: PrefillSplitTuning, q: torch.Tensor, k_cache: torch.Tensor,
             meta: AttentionMetadata, group: int) -> PrefillPlan:
    """plan_prefill for a launch on q's device."""
    return plan_prefill(tuning, meta, q.shape[0], group, k_cache.shape[2], k_cache.shape[1], num_sms(q.device))


def paged_prefill_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, group: int, tuning: PrefillSplitTuning, plan: PrefillPlan) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim] (head_dim contiguous), sequences back to back per
    meta.query_start_loc -> out, same shape. Grid and allocations depend on shapes and `plan` only."""
    num_tokens, num_heads, head_dim, num_kv_heads, block_size, num_seqs = prefill_shape(q, k_cache, meta)
    block_tables = meta.block_tables  # [num_seqs, W]
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    splits, head_dim_pad = plan.splits, pad_dim(head_dim)
    if splits > 1:
        # One allocation (prefill runs eager: each is host time per layer), viewed as the three partials:
        # output [tokens, heads, splits, head_dim_pad], then max and sum [tokens, heads, splits], each view
        # 16-byte aligned (Triton compiles a variant per pointer alignment class).
        rows = num_tokens * num_heads * splits
        rows_pad = triton.cdiv(rows, 4) * 4
        partials = torch.empty(rows * head_dim_pad + 2 * rows_pad, device=q.device, dtype=torch.float32)
        part_out, part_max, part_sum = partials.split([rows * head_dim_pad, rows_pad, rows_pad])
    else:
        part_out = part_max = part_sum = out  # unused: the kernel writes `out` directly
    grid = (num_tokens // plan.block_q + num_seqs, num_kv_heads, splits)
    _prefill_split_kernel[grid](
        q, k_cache, v_cache, out, part_out, part_max, part_sum,
        block_tables, meta.context_lens, meta.query_start_loc,
        scale * LOG2E, num_seqs, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=triton.next_power_of_2(group), BLOCK_Q=plan.block_q,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=tuning.block_n, SPLIT=splits > 1, **dot_settings(q.dtype),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    if splits > 1:
        # One padded split count for every launch (masked past `splits`): one compiled reduce per model.
        splits_pad = triton.next_power_of_2(max(splits, tuning.max_splits))
        # Heads per reduce program: about _REDUCE_TILE partial values each (few, large programs).
        heads_per_program = min(triton.next_power_of_2(num_heads),
                                max(1, _REDUCE_TILE // (splits_pad * head_dim_pad)))
        _prefill_reduce_kernel[(num_tokens, triton.cdiv(num_heads, heads_per_program))](
            out, part_out, part_max, part_sum, meta.query_start_loc, num_seqs, splits,
            out.stride(0), out.stride(1), NUM_HEADS=num_heads, HEADS_PER_PROGRAM=heads_per_program, HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad, SPLITS_PAD=splits_pad, num_warps=4,
        )
    return out
