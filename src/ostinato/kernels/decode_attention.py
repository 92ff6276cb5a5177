"""Split-KV (flash-decoding) decode attention over the paged KV cache, in Triton.

Layout: attention/base.py (k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]).

Algorithm
    split     grid (num_seqs, num_kv_heads, num_splits). A program owns one kv head and all GROUP query
              heads that read it, so each K/V tile is loaded once per group: scores are a
              [GROUP_PAD, head_dim] x [head_dim, BLOCK_N] tl.dot (GROUP padded to 16 rows, the smallest
              tl.dot tile). It walks one of num_splits contiguous slices of the context with an online
              softmax in fp32 (exp2, scale folded with log2 e). K and V tiles are loaded [BLOCK_N, head_dim],
              head_dim contiguous (16-byte loads), token rows gathered through the block table.
              The slice length is data, not shape: cdiv(context, num_splits) rounded up to BLOCK_N, read
              from context_lens in the kernel. A context of 512 split 32 ways is 16 slices of 32 tokens and
              16 programs that return at once; a context of 32k is 32 slices of 1024. The grid depends on
              num_splits alone, so a captured graph stays valid for every context the table holds.
    merge     the active slices' partials (max, sum, unnormalised output) become the output. In
              the same launch: each slice stores its partials, then counts its arrival on a per-(sequence,
              kv head) counter (atomic add, acq_rel, after a CTA barrier, so the partials are published
              before the count); the slice that arrives last merges them all at once and resets the counter
              to 0, so the next launch (or graph replay) starts clean. One launch per layer, where the
              two-kernel form paid a second dependent launch (~2 us at batch 1, docs/PERFORMANCE.md).
              With num_splits == 1 the split kernel normalises and writes the output itself: no merge at all.

    rope      (decode_with_rope, the decoder's Triton path) q comes in as the fused qkv projection: each
              program normalises (Qwen3) and rotates its group's q rows itself; the slices cut the
              context_len - 1 cached tokens, and the last active one also computes the newest token's k
              (normalised, rotated) and v, writes them to slot_mapping[seq] and attends to them from registers,
              while every slice reads only cached tokens (so no program reads a slot written in this launch). This
              replaces the q/k-norm + RoPE kernel's launch at decode; prefill keeps that kernel.

    pdl       (DecodeTuning.pdl) the slice's first K/V tile is read before the wait for the qkv projection
              (PREFETCH). The trigger that lets o_proj launch comes first thing where the launch holds few active
              programs, and after the K/V loop where it holds many (late_trigger_programs): launched at once onto
              a GPU this launch fills, o_proj's programs would sit, and then run, on the few SMs with room.

Choosing num_splits (choose_num_splits): from shapes only (batch, kv heads, block-table width, SM count),
so it is fixed before a graph is captured and never changes during replays. A batch whose own programs
(num_seqs * num_kv_heads) already cover every SM is not split (no merge); a smaller one is split
until the GPU holds `programs_per_sm` programs per SM, but no further than one BLOCK_N tile per slice of
the widest context the table can hold, nor than max_splits. On a GPU of 132 SMs with 8 kv heads, batch 1
splits 32 ways at a 2048-token table (64 at 32k), batch 16 4 ways, batch >= 17 not at all; except that a
table wider than max_keys_per_program (2048) tokens always splits so that no program scans more (batch 64
at an 8448-token table: 5 ways), since one long sequence would otherwise straggle.

Why not fixed-size partitions (the kernel this replaced): a partition of 256 tokens gave batch 1 at context
512 only 2 partitions x 8 kv heads = 16 programs for 132 SMs, each looping over 256 tokens; and the
partition count came from the table width (the max model length), so a batch of 64 launched
programs for every partition of a 2048-token table, most of them empty, plus a reduce.

Determinism (tests/runner/test_decode_replay.py): the same inputs at the same row count give the same bits, in a
graph or eager, whichever slice arrives last: the merge reads every active partial in slice order, and the
count it waits on is published the way CUTLASS's split-K barrier does it (CTA barrier, then one thread's
release) and acquired before a CTA barrier and L2-only (.cg) loads (the PTX of triton 3.6 and 3.9 for
sm_90 reads that way). No program reads a slot written in the same launch: the new token comes from
registers, and a graph's pad rows (context 1, all in the scratch block) read no cache at all, so their
racing writes to the scratch slot are never read. What does differ: the split count depends on the row
count, so n rows eager and the same n rows padded into a graph of S rows may sum in another order (as the
GEMMs, whose kernels cuBLAS picks by M, do too).

Limits: as attention/triton_paged.py (any head_dim, padded; block_size any; fp32/bf16/fp16). Run once
before capture so that Triton compiles outside it (the runner's warm-up does), and so that the arrival
counters (SplitCounters, allocated once, zeroed) exist before it. Decode launches of one backend must not
run concurrently on two streams: they share the counters (a decode step is one stream; the runner's
warm-up and capture stream waits for the serving stream and the other way round).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.kernels import deferred_launch
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.split_counters import SplitCounters
from ostinato.kernels.decode_output import merge_partials, store_heads
from ostinato.kernels.decode_plan import DecodeRope, DecodeTuning, choose_num_splits
from ostinato.kernels.gguf_int8_dot import QuantizedX
from ostinato.kernels.device import num_sms
from ostinato.kernels.rope_tile import load_norm_rope, norm_weights, rope_table
from ostinato.kernels.attention_common import (KERNELS_INTERPRETED, LOG2E, dot, dot_settings, kv_to_cache, loop_query,
                                               pad_dim, paged_kv_offsets, to_loop_type)

__all__ = ["DecodeRope", "DecodeTuning", "SplitCounters", "choose_num_splits", "paged_decode"]


@triton.jit
def _split_span(context_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per slice for this context: cdiv(context, num_splits) up to a multiple of BLOCK_N (>= BLOCK_N,
    so a context of 0 has a span and no active slice)."""
    span = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(span, BLOCK_N)


@triton.jit
def _slices(context_len, num_splits, BLOCK_N: tl.constexpr, ROPE: tl.constexpr):
    """(span, num_active): tokens per slice and the slices holding any. With ROPE the newest token comes from
    registers, not the cache, so the slices cut the context_len - 1 cached tokens and the last of them takes
    the newest one too (at least one slice, which merges). Cutting the whole context instead gave a context of
    512 cached tokens + 1 (a step at "context 512") a slice of its own for the one new token: 5 active slices
    of 128 at batch 16 (640 programs) where 4 hold the cache (512)."""
    if ROPE:
        cached = context_len - 1
        span = _split_span(cached, num_splits, BLOCK_N)
        return span, tl.maximum(tl.cdiv(cached, span), 1)
    span = _split_span(context_len, num_splits, BLOCK_N)
    return span, tl.cdiv(context_len, span)


@triton.jit
def _load_kv_tile(k_cache_ptr, v_cache_ptr, q_ptr, block_tables_ptr, seq_row, tok0, end, kv_head, offs_n, offs_d,
                  d_mask, stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr):
    """K and V of tokens [tok0, tok0 + BLOCK_N) below `end`, [BLOCK_N, HEAD_DIM_PAD] each (0 past end) in the
    loop's type (to_loop_type), and the token mask [BLOCK_N]."""
    toks = tok0 + offs_n
    n_mask = toks < end
    if HEAD_DIM == HEAD_DIM_PAD:
        kv_mask = n_mask[:, None]  # no padded columns: a row mask keeps the loads 16 bytes wide
    else:
        kv_mask = n_mask[:, None] & d_mask[None, :]
    kv_offs = paged_kv_offsets(block_tables_ptr, seq_row, toks, n_mask, kv_head, stride_cache_block,
                               stride_cache_tok, stride_cache_head, BLOCK_SIZE)
    tile = kv_offs[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
    k = to_loop_type(tl.load(k_cache_ptr + tile, mask=kv_mask, other=0.0), k_cache_ptr, q_ptr)
    v = to_loop_type(tl.load(v_cache_ptr + tile, mask=kv_mask, other=0.0), k_cache_ptr, q_ptr)
    return k, v, n_mask


@triton.jit
def _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2e, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One step of the online softmax over a K/V tile holding at least one valid token."""
    s = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [GROUP_PAD, BLOCK_N]
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
    return m_new, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, counters_ptr,
    q_weight_ptr, k_weight_ptr, cos_sin_ptr, positions_ptr, slot_mapping_ptr,
    xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr,
    scale_log2e, num_splits, eps, late_trigger_programs,
    stride_qs, stride_qh, stride_os, stride_oh, stride_cs,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, MERGE_GROUP: tl.constexpr, MERGE_CHUNK: tl.constexpr,
    SPLITS_PAD: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ROPE: tl.constexpr, QK_NORM: tl.constexpr, EMULATE_BF16: tl.constexpr, PDL: tl.constexpr,
    PREFETCH: tl.constexpr, QUANT_OUT: tl.constexpr,
):
    # num_splits is a run-time argument (one compiled kernel for every split count); SPLIT = num_splits > 1,
    # and then the last split to finish merges the partials (no reduce launch). ROPE: q_ptr is the qkv
    # projection [num_seqs, H + 2Hkv, D]; the kernel normalises (QK_NORM) and rotates q itself, and the
    # slice holding the newest token computes its k and v, writes them to slot_mapping[seq] and attends
    # to them from registers (decode_with_rope: no q/k-norm + RoPE launch before the attention).
    # PREFETCH (PDL with ROPE, kernels/pdl.py): the slice's first K/V tile is read before the wait, with the context
    # length, block table and RoPE row it needs, and the q/k norm weights: no kernel of the step writes any of
    # them (weights never; the step's inputs are complete before its first PDL kernel; and with ROPE no slice
    # reads the one slot this layer writes: the newest token comes from registers). Without it nothing
    # precedes the wait. QUANT_OUT: the output goes to xq_ptr .. s16_ptr quantized for o_proj's integer dot
    # products instead of to out_ptr (kernels/decode_output.py).
    if not PREFETCH:
        pdl_wait(PDL)
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    span, num_active = _slices(context_len, num_splits, BLOCK_N, ROPE)
    start = split * span
    # Slices holding tokens; a split launch gives a context of 0 one (empty) slice, so that somebody
    # arrives, merges and writes the zeros.
    if SPLIT:
        num_active = tl.maximum(num_active, 1)
    # The PDL trigger (DecodeTuning.late_trigger_programs says why): first thing where the launch holds few
    # active programs, else once this program has walked its slice. Each program estimates the launch's active
    # programs from its own sequence's slices; a program that returns early counts as triggered.
    early_trigger = tl.num_programs(0) * NUM_KV_HEADS * num_active < late_trigger_programs
    if early_trigger:
        pdl_begin(PDL)
    if SPLIT:
        if split >= num_active:
            return  # an inactive slice: the merge reads only the active ones

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads reading this kv head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh  # [GROUP_PAD, 1]
    if ROPE:
        end = tl.minimum(start + span, context_len - 1)  # the newest token comes from registers, below (the
        # last active slice's: with the slices cut over the cached tokens, its position may lie past start + span)
        cos, signed_sin = rope_table(cos_sin_ptr, tl.load(positions_ptr + seq), stride_cs, offs_d, HEAD_DIM)
        q_w, q_w_partner = norm_weights(q_weight_ptr, offs_d, HEAD_DIM, QK_NORM)
        k_w, k_w_partner = norm_weights(k_weight_ptr, offs_d, HEAD_DIM, QK_NORM)
    else:
        end = tl.minimum(start + span, context_len)
    # Every tile holds at least one valid token (tok0 < end), so m_i is finite after the first. The first
    # tile is loaded ahead of the loop (before the wait with PREFETCH).
    k_first, v_first, n_first = _load_kv_tile(k_cache_ptr, v_cache_ptr, q_ptr, block_tables_ptr, seq * stride_bt,
                                              start, end, kv_head, offs_n, offs_d, d_mask, stride_cache_block,
                                              stride_cache_tok, stride_cache_head, BLOCK_SIZE, HEAD_DIM,
                                              HEAD_DIM_PAD)
    if PREFETCH:
        pdl_wait(PDL)
    if ROPE:
        # The newest token's k and v rows are requested with q's, in the same round trip to L2, by the slice
        # that holds it (other programs' loads are masked off). Loaded after the loop, they were one more
        # dependent read on the path of that slice, which is the one the merge usually waits for.
        newest = split == num_active - 1
        one = tl.arange(0, 1)
        newest_row = (split + one[:, None]) == num_active - 1  # [1, 1] (a tensor mask: the interpreter's too)
        k_row = q_ptr + seq * stride_qs + (NUM_HEADS + kv_head + one)[:, None] * stride_qh  # [1, 1]
        k_new = load_norm_rope(k_row, newest_row, offs_d, k_w, k_w_partner, cos, signed_sin, eps, q_ptr, HEAD_DIM,
                               QK_NORM, EMULATE_BF16)  # [1, HEAD_DIM_PAD] fp32, rounded
        v_new = tl.load(k_row + NUM_KV_HEADS * stride_qh + offs_d[None, :], mask=newest_row & d_mask[None, :],
                        other=0.0)
        q = load_norm_rope(q_rows, g_mask[:, None], offs_d, q_w, q_w_partner, cos, signed_sin, eps, q_ptr,
                           HEAD_DIM, QK_NORM, EMULATE_BF16).to(q_ptr.dtype.element_ty)  # [GROUP_PAD, HEAD_DIM_PAD]
        if newest:
            slot = tl.load(slot_mapping_ptr + seq).to(tl.int64)
            if slot >= 0:  # a negative slot writes nowhere (as write_kv); padded rows use the scratch block
                dst = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_tok \
                    + kv_head * stride_cache_head + offs_d[None, :]
                tl.store(k_cache_ptr + dst, kv_to_cache(k_new, k_cache_ptr), mask=d_mask[None, :])
                tl.store(v_cache_ptr + dst, kv_to_cache(v_new, v_cache_ptr), mask=d_mask[None, :])
        if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
            # The newest key and value enter the sums as the cache holds them, as every later step reads them.
            k_new = kv_to_cache(k_new, k_cache_ptr).to(tl.float32)
            v_new = to_loop_type(kv_to_cache(v_new, v_cache_ptr), k_cache_ptr, q_ptr)
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    q = loop_query(q, k_cache_ptr, q_ptr)

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    if start < end:
        m_i, l_i, acc = _attend_tile(q, k_first, v_first, n_first, m_i, l_i, acc, scale_log2e, DOT_PRECISION,
                                     UPCAST_DOT)
    for tok0 in range(start + BLOCK_N, end, BLOCK_N):
        k, v, n_mask = _load_kv_tile(k_cache_ptr, v_cache_ptr, q_ptr, block_tables_ptr, seq * stride_bt, tok0,
                                     end, kv_head, offs_n, offs_d, d_mask, stride_cache_block, stride_cache_tok,
                                     stride_cache_head, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD)
        m_i, l_i, acc = _attend_tile(q, k, v, n_mask, m_i, l_i, acc, scale_log2e, DOT_PRECISION, UPCAST_DOT)
    if not early_trigger:
        pdl_begin(PDL)

    if ROPE:
        if newest:  # the slice holding position context_len - 1: its k and v were loaded and written above
            # The loop's step for one more key: q . k in fp32 (the dot's products are exact in fp32 too),
            # p rounded to the value dtype as the loop's P @ V does.
            s_new = tl.sum(q.to(tl.float32) * k_new, 1) * scale_log2e  # [GROUP_PAD]
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p
            acc = acc * alpha[:, None] + p.to(v_new.dtype).to(tl.float32)[:, None] * v_new.to(tl.float32)
            m_i = m_new

    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context 0 -> zeros, not NaN
        store_heads(out, out_ptr, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, seq, kv_head, stride_os, stride_oh,
                    GROUP_PAD, NUM_HEADS, GROUP, HEAD_DIM, HEAD_DIM_PAD, QUANT_OUT, EMULATE_BF16)
    else:
        # Partials: [num_seqs, NUM_HEADS, num_splits] (+ [HEAD_DIM_PAD] for the output), contiguous.
        part_idx = (seq * NUM_HEADS + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + part_idx, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part_idx, l_i, mask=g_mask)
        tl.store(part_out_ptr + part_idx[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=g_mask[:, None])
        # Publish, then count: every thread's partial stores are issued before the barrier, and the
        # release half of the counter's acq_rel makes them visible (cumulatively) to whoever acquires
        # the count after us. One thread performs the scalar atomic; Triton broadcasts its result.
        tl.debug_barrier()
        counter = counters_ptr + seq * NUM_KV_HEADS + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_active - 1:
            # The last to arrive: its acquire saw every other slice's release. Reset the counter for
            # the next launch (graph replays reuse it; launches on one stream never overlap).
            tl.debug_barrier()
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
            out = merge_partials(part_out_ptr, part_max_ptr, part_sum_ptr, seq, kv_head, num_active, num_splits,
                                 NUM_HEADS, GROUP, MERGE_GROUP, HEAD_DIM, HEAD_DIM_PAD, MERGE_CHUNK, SPLITS_PAD)
            store_heads(out, out_ptr, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, seq, kv_head, stride_os, stride_oh,
                        MERGE_GROUP, NUM_HEADS, GROUP, HEAD_DIM, HEAD_DIM_PAD, QUANT_OUT, EMULATE_BF16)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, group: int, tuning: DecodeTuning,
                 counters: SplitCounters, rope: DecodeRope | None = None,
                 quantized: QuantizedX | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] (head_dim contiguous) -> out, same shape. With `rope`, q is the qkv
    projection [num_seqs, num_heads + 2 * num_kv_heads, head_dim] instead (heads q | k | v, as from the
    fused projection): q and the new k are normalised and rotated here, the new K/V written to the cache,
    and context_lens count the new token (>= 1). With `quantized` (room for num_seqs rows of num_heads *
    head_dim, head_dim a power of two >= 32) the output goes there as gguf_int8_dot.quantize_x would make it
    from out, and out is left unwritten. CUDA-graph safe: no host sync, and every allocation and the grid depend
    on shapes only."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if rope is not None:
        num_heads -= 2 * num_kv_heads
        assert num_heads == group * num_kv_heads and head_dim % 2 == 0
        assert rope.cos_sin_cache.shape[-1] == 2 * head_dim and rope.cos_sin_cache.stride(-1) == 1
        assert rope.cos_sin_cache.dtype == q.dtype and rope.positions.shape == rope.slot_mapping.shape == (num_seqs,)
        assert (rope.q_weight is None) == (rope.k_weight is None)
    out = torch.empty(num_seqs, num_heads, head_dim, device=q.device, dtype=q.dtype)
    if quantized is not None:
        assert head_dim >= 32 and head_dim == pad_dim(head_dim) and q.dtype in (torch.bfloat16, torch.float16)
        assert quantized.xq.shape == (num_seqs, num_heads * head_dim // 4) and quantized.xq.is_contiguous()
    if num_seqs == 0:
        return out
    sms = num_sms(q.device)
    splits = choose_num_splits(tuning, num_seqs, num_kv_heads, block_tables.shape[1] * block_size, sms)
    head_dim_pad = pad_dim(head_dim)
    if splits > 1:
        # Sized by shapes only, so allocating here is fine inside a CUDA-graph capture (graph pool).
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim_pad, device=q.device, dtype=torch.float32)
        part_max = torch.empty(num_seqs, num_heads, splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused: the kernel writes `out` directly
    arrivals = counters.get(q.device, num_seqs * num_kv_heads) if splits > 1 else out  # unused unsplit
    splits_pad = triton.next_power_of_2(tuning.merge_slices(splits))
    merge_group = triton.next_power_of_2(group)
    # Merge tile [merge_group, chunk, head_dim_pad] of at most merge_chunk_elems fp32 (DecodeTuning says why).
    merge_chunk = max(1, min(splits_pad, tuning.merge_chunk_elems // (merge_group * head_dim_pad)))
    num_warps, num_stages = tuning.launch_for(splits, num_seqs * num_kv_heads, sms)
    if rope is not None:
        norm = rope.q_weight is not None
        rope_args = (rope.q_weight if norm else q, rope.k_weight if norm else q, rope.cos_sin_cache, rope.positions,
                     rope.slot_mapping)  # q stands in for the unread weights without qk-norm
        eps, stride_cs = rope.eps, rope.cos_sin_cache.stride(0)
    else:
        rope_args, eps, stride_cs, norm = (q,) * 5, 0.0, 0, False  # unread placeholders
    # Deferred (kernels/deferred_launch.py) it writes nothing: neither `out` nor `quantized` (zeroed) nor the new
    # token's K/V, which only this pass's own later reads would see.
    deferred_launch.launch(_decode_split_kernel, (num_seqs, num_kv_heads, splits), (
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_max, part_sum, arrivals, *rope_args, *(quantized if quantized is not None else (q,) * 5),
        scale * LOG2E, splits, eps, tuning.late_trigger_programs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), stride_cs,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
    ), dict(
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=pad_dim(group),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tuning.block_n,
        SPLIT=splits > 1, MERGE_GROUP=merge_group, MERGE_CHUNK=merge_chunk, SPLITS_PAD=splits_pad,
        ROPE=rope is not None, QK_NORM=norm, EMULATE_BF16=KERNELS_INTERPRETED and q.dtype == torch.bfloat16,
        PDL=tuning.pdl, PREFETCH=tuning.pdl and rope is not None, QUANT_OUT=quantized is not None,
        **dot_settings(q.dtype),
        num_warps=num_warps, num_stages=num_stages, **launch_options(tuning.pdl),
    ), (out,) if quantized is None else tuple(quantized))
    return out
