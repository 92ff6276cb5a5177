"""Triton attention over the paged KV cache: K/V write, split-KV decode, varlen causal prefill.

Memory layout (attention/base.py)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous, both with the
    same strides. Token t of sequence s lives in block block_tables[s, t // block_size] at offset
    t % block_size; slot = block * block_size + offset. q/k/v may be strided views (e.g. slices of a fused
    qkv projection) as long as head_dim is contiguous.

Algorithm
    write_kv   one program per token copies its [num_kv_heads, head_dim] K and V rows to their slot.
               Negative slots are skipped (the vLLM convention for padding), so a runner may use either a
               sentinel slot or the scratch block for padded rows.
    decode     flash-decoding. Grid (num_seqs, num_kv_heads, num_partitions): each program owns one kv head
               and all GROUP = num_heads // num_kv_heads query heads that read it, so K/V tiles are loaded
               once per group: scores are a [GROUP_PAD, head_dim] x [head_dim, BLOCK_N] tl.dot (GROUP padded
               to >= 16 rows, the minimum tl.dot tile). Each program walks one partition of the context
               (partition_size tokens, gathered token by token through the block table, so BLOCK_N does not
               depend on block_size) with an online softmax in fp32 (exp2, scale folded with log2 e).
               num_partitions = cdiv(W * block_size, partition_size) from the block-table width W alone,
               so the launch grid depends only on tensor shapes (CUDA-graph safe: no .item(), no host sync,
               allocations sized by shapes). Partitions past a sequence's context do no work; a second
               kernel merges the per-partition (max, sum, unnormalised output) triples. With a single
               partition the first kernel writes the normalised output itself and no reduce is launched.
    prefill    varlen flash attention. Grid (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads); a
               program takes BLOCK_Q new tokens of one sequence times its GROUP query heads as the rows of
               one tile, and scans the sequence's cache from position 0 up to its last query, with the
               causal mask key_pos <= query_pos where query i of a sequence with context C and Q new tokens
               sits at position C - Q + i. So an already-cached prefix (prefix caching, chunked prefill,
               recompute after preemption) is read from the cache like any other token.

Limits
    head_dim: any size; tiles are padded to the next power of two >= 16 (64 and 128 need no padding).
    block_size: any positive integer (powers of two are what the engine uses).
    num_heads must be a multiple of num_kv_heads. fp32, bf16 and fp16; fp32 dots run in IEEE precision
    (not TF32) so fp32 results match the torch reference tightly.
    Triton compiles each kernel on its first call: run decode once before capturing a CUDA graph (the
    runner's warm-up does) so that compilation happens outside the capture.
    context_lens[s] must not exceed W * block_size (the runner guarantees it); a row with context 0 gets
    zeros, never NaN.
    Tiles (TritonAttentionTuning) were chosen so bf16/fp16 kernels at head_dim 64/128, GQA 1-8 compile for
    sm_90 (triton 3.9, read back with cuobjdump) with no or tiny register spills; not benchmark-tuned. fp32 prefill
    spills at the default tile (fp32 is the correctness path, not the fast one).
    Under TRITON_INTERPRET=1 (CPU tests) bf16 dots multiply in fp32 after the same rounding, because the
    interpreter's bf16 tl.dot multiplies raw bit patterns (triton 3.9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from .base import AttentionBackend, AttentionMetadata


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
        tl.store(k_cache_ptr + dst_offs, k, mask=mask)
        tl.store(v_cache_ptr + dst_offs, v, mask=mask)


@triton.jit
def _paged_kv_offsets(block_tables_ptr, seq_row, toks, tok_mask, kv_head, stride_cache_block,
                      stride_cache_tok, stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64: a pool may exceed 2**31 elements) of tokens `toks` of one sequence,
    kv head `kv_head`, in the paged cache. [BLOCK_N]"""
    block = tl.load(block_tables_ptr + seq_row + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    return block * stride_cache_block + (toks % BLOCK_SIZE) * stride_cache_tok + kv_head * stride_cache_head


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """tl.dot; UPCAST_DOT multiplies in fp32 instead (exact for 16-bit inputs, fp32 accumulation either
    way). Set only under the interpreter, whose bf16 tl.dot multiplies raw bit patterns (triton 3.9)."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2e,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, NUM_PARTITIONS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    start = part * PARTITION_SIZE
    end = tl.minimum(start + PARTITION_SIZE, context_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g  # [GROUP_PAD] query heads reading this kv head
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)  # [GROUP_PAD, HEAD_DIM_PAD]

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp2
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Every iteration holds at least one valid token (tok0 < end), so m_i is finite after the first.
    for tok0 in range(start, end, BLOCK_N):
        toks = tok0 + offs_n
        n_mask = toks < end
        kv_offs = _paged_kv_offsets(block_tables_ptr, seq * stride_bt, toks, n_mask, kv_head,
                                    stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE)
        k_t = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        s = _dot(q, k_t, DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    if NUM_PARTITIONS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context 0 -> zeros, not NaN
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials are [num_seqs, NUM_HEADS, NUM_PARTITIONS] (+ [HEAD_DIM_PAD] for the output), contiguous.
        part_idx = (seq * NUM_HEADS + heads) * NUM_PARTITIONS + part  # [GROUP_PAD]
        tl.store(part_max_ptr + part_idx, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part_idx, l_i, mask=g_mask)
        tl.store(part_out_ptr + part_idx[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr,
    stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, NUM_PARTITIONS: tl.constexpr, PART_CHUNK: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    # Only partitions that overlap the context were written; partition 0 always holds token 0.
    num_valid = tl.minimum(tl.cdiv(context_len, PARTITION_SIZE), NUM_PARTITIONS)
    base = (seq * NUM_HEADS + head) * NUM_PARTITIONS
    offs_p = tl.arange(0, PART_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)

    m_run = float("-inf")
    l_run = 0.0
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for p0 in range(0, num_valid, PART_CHUNK):
        parts = p0 + offs_p
        p_mask = parts < num_valid
        m_p = tl.load(part_max_ptr + base + parts, mask=p_mask, other=float("-inf"))  # [PART_CHUNK]
        l_p = tl.load(part_sum_ptr + base + parts, mask=p_mask, other=0.0)
        o_p = tl.load(part_out_ptr + (base + parts)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                      mask=p_mask[:, None], other=0.0)  # [PART_CHUNK, HEAD_DIM_PAD]
        m_new = tl.maximum(m_run, tl.max(m_p, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m_p - m_new)  # masked partitions: exp2(-inf) = 0
        acc = acc * alpha + tl.sum(o_p * w[:, None], 0)
        l_run = l_run * alpha + tl.sum(l_p * w, 0)
        m_run = m_new

    out = acc / tl.where(l_run == 0.0, 1.0, l_run)  # context 0: no partition ran, output zeros
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, context_lens_ptr, query_start_loc_ptr,
    scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
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

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    # Keys up to the last query of this block; key 0 is visible to every row, so m_i is finite after one step.
    kv_end = cached_prefix + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    for tok0 in range(0, kv_end, BLOCK_N):
        toks = tok0 + offs_n
        n_mask = toks < kv_end
        kv_offs = _paged_kv_offsets(block_tables_ptr, seq * stride_bt, toks, n_mask, kv_head,
                                    stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE)
        k_t = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        s = _dot(q, k_t, DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [ROWS, BLOCK_N]
        visible = n_mask[None, :] & (toks[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


# True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors (tests, CI).
_KERNELS_INTERPRETED = type(_write_kv_kernel).__name__ == "InterpretedFunction"
_LOG2E = 1.4426950408889634
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class TritonAttentionTuning:
    """Tile sizes and launch settings. Defaults avoid register spills for bf16/fp16 at head_dim 128 on
    sm_90 (checked with cuobjdump -res-usage, not on a GPU); they are not benchmark-tuned.

    partition_size: decode tokens per split-KV partition. Smaller partitions give small batches more
    parallel programs; the reduce kernel merges them. max_partitions bounds the partition count (and
    the reduce work) for very wide block tables by growing the partition instead.
    """

    partition_size: int = 256
    max_partitions: int = 64
    decode_block_n: int = 32  # tokens per decode inner-loop step
    decode_num_warps: int = 4
    prefill_block_m: int = 64  # rows per prefill program: queries x (query heads per kv head)
    prefill_block_n: int = 32
    prefill_num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("partition_size", "decode_block_n", "prefill_block_m", "prefill_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        for name in ("max_partitions", "decode_num_warps", "prefill_num_warps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton; see the module docstring for the algorithm, layout and limits."""

    name = "triton"

    def __init__(self, tuning: TritonAttentionTuning | None = None):
        self.tuning = tuning or TritonAttentionTuning()

    # ---- K/V write -------------------------------------------------------------------------------------

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
        _check_inputs(k, k_cache, v_cache)
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
            HEAD_DIM=head_dim, HEAD_DIM_PAD=_pad_dim(head_dim), BLOCK_SIZE=k_cache.shape[1],
        )

    # ---- decode ----------------------------------------------------------------------------------------

    def decode_partitioning(self, max_blocks_per_seq: int, block_size: int) -> tuple[int, int]:
        """(partition_size, num_partitions) for a block table max_blocks_per_seq wide: shapes only, so a
        captured graph's grid stays valid for any context lengths that fit the table."""
        max_context = max_blocks_per_seq * block_size
        partition = self.tuning.partition_size
        if triton.cdiv(max_context, partition) > self.tuning.max_partitions:
            partition = triton.next_power_of_2(triton.cdiv(max_context, self.tuning.max_partitions))
        return partition, max(1, triton.cdiv(max_context, partition))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_seqs, num_heads, head_dim] -> out: [num_seqs, num_heads, head_dim]
        _check_inputs(q, k_cache, v_cache)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = _group_size(num_heads, num_kv_heads)
        q = _contiguous_last(q)
        block_tables, context_lens = meta.block_tables, meta.context_lens  # [num_seqs, W], [num_seqs]
        assert block_tables.shape[0] == num_seqs and context_lens.shape == (num_seqs,)
        out = torch.empty_like(q)
        if num_seqs == 0:
            return out
        partition, num_parts = self.decode_partitioning(block_tables.shape[1], block_size)
        head_dim_pad = _pad_dim(head_dim)
        if num_parts > 1:
            # Sized by shapes only, so allocating here is fine inside a CUDA-graph capture (graph pool).
            part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim_pad, device=q.device,
                                   dtype=torch.float32)
            part_max = torch.empty(num_seqs, num_heads, num_parts, device=q.device, dtype=torch.float32)
            part_sum = torch.empty_like(part_max)
        else:
            part_out = part_max = part_sum = out  # unused: the kernel writes `out` directly
        _decode_partition_kernel[(num_seqs, num_kv_heads, num_parts)](
            q, k_cache, v_cache, block_tables, context_lens,
            out, part_out, part_max, part_sum,
            scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=_pad_dim(group),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size,
            BLOCK_N=min(self.tuning.decode_block_n, partition), PARTITION_SIZE=partition,
            NUM_PARTITIONS=num_parts, **_dot_settings(q.dtype),
            num_warps=self.tuning.decode_num_warps,
        )
        if num_parts > 1:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                out, part_out, part_max, part_sum, context_lens,
                out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
                PARTITION_SIZE=partition, NUM_PARTITIONS=num_parts,
                PART_CHUNK=min(16, triton.next_power_of_2(num_parts)),
                num_warps=4,
            )
        return out

    # ---- prefill ---------------------------------------------------------------------------------------

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], sequences back to back per query_start_loc -> same shape
        _check_inputs(q, k_cache, v_cache)
        assert meta.query_start_loc is not None, "prefill needs meta.query_start_loc"
        # The grid comes from max_query_len: one too small would leave rows of `out` unwritten.
        assert meta.query_lens is None or max(meta.query_lens, default=0) <= meta.max_query_len
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = _group_size(num_heads, num_kv_heads)
        q = _contiguous_last(q)
        block_tables = meta.block_tables  # [num_seqs, W]
        num_seqs = block_tables.shape[0]
        out = torch.empty_like(q)
        if num_tokens == 0 or num_seqs == 0:
            return out
        group_pad = triton.next_power_of_2(group)
        block_q = max(1, self.tuning.prefill_block_m // group_pad)  # rows = block_q * group_pad >= 16
        grid = (triton.cdiv(max(meta.max_query_len, 1), block_q), num_seqs, num_kv_heads)
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, meta.context_lens, meta.query_start_loc,
            scale * _LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=_pad_dim(head_dim), BLOCK_SIZE=block_size,
            BLOCK_N=self.tuning.prefill_block_n, **_dot_settings(q.dtype),
            num_warps=self.tuning.prefill_num_warps,
        )
        return out


def _check_inputs(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Host-side attribute checks only (no sync), so they are safe inside a graph capture."""
    if not x.is_cuda and not _KERNELS_INTERPRETED:
        raise ConfigError(
            f"the triton attention backend runs on CUDA tensors, got {x.device}; use "
            "--attention-backend torch on CPU (tests may set TRITON_INTERPRET=1 before importing triton)"
        )
    if x.dtype not in _SUPPORTED_DTYPES or k_cache.dtype != x.dtype:
        raise ConfigError(
            f"the triton attention backend supports float32, bfloat16 and float16 with a KV cache of the "
            f"same dtype; got activations {x.dtype} and cache {k_cache.dtype}: pick one of those with --dtype"
        )
    # Internal invariants: the runner allocates both caches identically.
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"


def _group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def _pad_dim(n: int, minimum: int = 16) -> int:
    """Triton tiles are powers of two and tl.dot needs >= 16 along each dimension."""
    return max(minimum, triton.next_power_of_2(n))


def _contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _dot_settings(dtype: torch.dtype) -> dict:
    """The tl.dot constexprs of the attention kernels."""
    # The interpreter's bf16 tl.dot is wrong (see _dot); multiply in fp32 there.
    upcast = _KERNELS_INTERPRETED and dtype == torch.bfloat16
    return {
        # fp32 inputs would default to TF32 on tensor cores (10-bit mantissa); keep fp32 exact.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32",
        "UPCAST_DOT": upcast,
    }
