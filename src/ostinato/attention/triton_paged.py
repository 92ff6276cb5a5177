"""Triton attention over the paged KV cache: K/V write, split-KV decode, varlen causal prefill.

Memory layout (attention/base.py)
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], last dim contiguous, both with the
    same strides. Token t of sequence s lives in block block_tables[s, t // block_size] at offset
    t % block_size; slot = block * block_size + offset. q/k/v may be strided views (e.g. slices of a fused
    qkv projection) as long as head_dim is contiguous.

Algorithm
    write_kv   one program per token copies its [num_kv_heads, head_dim] K and V rows to their slot.
               Negative slots are skipped (the vLLM convention for padding), so a runner may use either a
               sentinel slot or the scratch block for padded rows. The decoder's Triton kernel set skips
               this launch: its q/k-norm + RoPE kernel writes K/V itself (accepts_fused_kv_write).
    decode     split-KV flash-decoding, GQA-aware, split count chosen per shape, partials merged by the last
               slice to finish (one launch): kernels/decode_attention.py.
    prefill    varlen flash attention. Grid (cdiv(max_query_len, BLOCK_Q), num_seqs, num_kv_heads); a
               program takes BLOCK_Q new tokens of one sequence times its GROUP query heads as the rows of
               one tile, and scans the sequence's cache from position 0 up to its last query, with the
               causal mask key_pos <= query_pos where query i of a sequence with context C and Q new tokens
               sits at position C - Q + i. So an already-cached prefix (prefix caching, chunked prefill,
               recompute after preemption) is read from the cache like any other token.
               When those programs are too few to fill the GPU and the context is long (a short chunk of a
               chunked prefill), prefill instead splits each program's key range over several programs:
               kernels/prefill_attention.py (when: kernels/prefill_plan.py).

Limits
    head_dim: any size; tiles are padded to the next power of two >= 16 (64 and 128 need no padding).
    block_size: any positive integer (powers of two are what the engine uses).
    num_heads must be a multiple of num_kv_heads. fp32, bf16 and fp16; fp32 dots run in IEEE precision
    (not TF32) so fp32 results match the torch reference tightly.
    Triton compiles each kernel on its first call: run decode once before capturing a CUDA graph (the
    runner's warm-up does) so that compilation happens outside the capture.
    context_lens[s] must not exceed W * block_size (the runner guarantees it); a row with context 0 gets
    zeros, never NaN.
    Prefill tiles (TritonAttentionTuning) were chosen so bf16/fp16 kernels at head_dim 64/128, GQA 1-8 compile
    for sm_90 (triton 3.9, read back with cuobjdump) with no or tiny register spills; not benchmark-tuned. fp32
    prefill spills at the default tile (fp32 is the correctness path, not the fast one).
    Under TRITON_INTERPRET=1 (CPU tests) bf16 dots multiply in fp32 after the same rounding, because the
    interpreter's bf16 tl.dot multiplies raw bit patterns (triton 3.9).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from ostinato.errors import ConfigError
from ostinato.attention.base import AttentionBackend, AttentionMetadata
from ostinato.kernels.prefill_plan import PrefillSplitTuning
from ostinato.kernels.attention_common import (
    LOG2E, check_inputs, contiguous_last, dot, dot_settings, group_size, pad_dim, paged_kv_offsets,
)
from ostinato.kernels.decode_attention import DecodeRope, DecodeTuning, SplitCounters, paged_decode
from ostinato.kernels.prefill_attention import paged_prefill_split, plan_for


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
        kv_offs = paged_kv_offsets(block_tables_ptr, seq * stride_bt, toks, n_mask, kv_head,
                                    stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE)
        k_t = tl.load(k_cache_ptr + kv_offs[None, :] + offs_d[:, None],
                      mask=n_mask[None, :] & d_mask[:, None], other=0.0)  # [HEAD_DIM_PAD, BLOCK_N]
        s = dot(q, k_t, DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [ROWS, BLOCK_N]
        visible = n_mask[None, :] & (toks[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_offs[:, None] + offs_d[None, :],
                    mask=n_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, HEAD_DIM_PAD]
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + tok_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@dataclass(frozen=True)
class TritonAttentionTuning:
    """Tile sizes and launch settings. `decode`: see kernels/decode_attention.py. The prefill defaults avoid
    register spills for bf16/fp16 at head_dim 128 on sm_90 (checked with cuobjdump -res-usage); they are
    not benchmark-tuned."""

    decode: DecodeTuning = field(default_factory=DecodeTuning)
    prefill_block_m: int = 64  # rows per prefill program: queries x (query heads per kv head)
    prefill_block_n: int = 32
    prefill_num_warps: int = 4
    prefill_split: PrefillSplitTuning = field(default_factory=PrefillSplitTuning)  # kernels/prefill_plan.py

    def __post_init__(self) -> None:
        for name in ("prefill_block_m", "prefill_block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ConfigError(f"{name} must be a power of two >= 16, got {value}")
        if self.prefill_num_warps < 1:
            raise ConfigError(f"prefill_num_warps must be >= 1, got {self.prefill_num_warps}")


class TritonPagedBackend(AttentionBackend):
    """Paged attention in Triton; see the module docstring for the algorithm, layout and limits."""

    name = "triton"
    accepts_fused_kv_write = True  # write_kv is then skipped on the Triton kernel set's path

    def __init__(self, tuning: TritonAttentionTuning | None = None):
        self.tuning = tuning or TritonAttentionTuning()
        self.pdl = self.tuning.decode.pdl
        self.split_counters = SplitCounters()  # the single-launch decode's workspace, shared by all layers

    # ---- K/V write -------------------------------------------------------------------------------------

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim]
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

    # ---- decode ----------------------------------------------------------------------------------------

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_seqs, num_heads, head_dim] -> out: [num_seqs, num_heads, head_dim]
        check_inputs(q, k_cache, v_cache)
        group = group_size(q.shape[1], k_cache.shape[2])
        block_tables, context_lens = meta.block_tables, meta.context_lens  # [num_seqs, W], [num_seqs]
        assert block_tables.shape[0] == q.shape[0] and context_lens.shape == (q.shape[0],)
        return paged_decode(contiguous_last(q), k_cache, v_cache, block_tables, context_lens, scale, group,
                            self.tuning.decode, self.split_counters)

    @property
    def decode_applies_rope(self) -> bool:  # type: ignore[override]  # fixed by the tuning, before capture
        return self.tuning.decode.apply_rope

    def decode_with_rope(self, heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                         cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # heads: [num_seqs, H + 2Hkv, D], the qkv projection -> out: [num_seqs, H, D]
        check_inputs(heads, k_cache, v_cache)
        num_kv_heads = k_cache.shape[2]
        group = group_size(heads.shape[1] - 2 * num_kv_heads, num_kv_heads)
        block_tables, context_lens = meta.block_tables, meta.context_lens  # [num_seqs, W], [num_seqs]
        assert block_tables.shape[0] == heads.shape[0] and context_lens.shape == (heads.shape[0],)
        rope = DecodeRope(q_weight, k_weight, cos_sin_cache, positions, meta.slot_mapping, eps)
        return paged_decode(contiguous_last(heads), k_cache, v_cache, block_tables, context_lens, scale, group,
                            self.tuning.decode, self.split_counters, rope)

    # ---- prefill ---------------------------------------------------------------------------------------

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim], sequences back to back per query_start_loc -> same shape
        check_inputs(q, k_cache, v_cache)
        assert meta.query_start_loc is not None, "prefill needs meta.query_start_loc"
        # The grid comes from max_query_len: one too small would leave rows of `out` unwritten.
        assert meta.query_lens is None or max(meta.query_lens, default=0) <= meta.max_query_len
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
        group = group_size(num_heads, num_kv_heads)
        q = contiguous_last(q)
        block_tables = meta.block_tables  # [num_seqs, W]
        num_seqs = block_tables.shape[0]
        # A short chunk over a long context: too few (query block, kv head) programs to fill the GPU, so
        # split the key range (kernels/prefill_attention.py). The plan uses the step's host figures when
        # meta has them, else shapes only (a captured prefill: leave query_lens / context_lens_host None).
        plan = plan_for(self.tuning.prefill_split, q, k_cache, meta, group)
        if plan.splits > 1:
            return paged_prefill_split(q, k_cache, v_cache, meta, scale, group, self.tuning.prefill_split, plan)
        out = torch.empty_like(q)
        if num_tokens == 0 or num_seqs == 0:
            return out
        group_pad = triton.next_power_of_2(group)
        block_q = max(1, self.tuning.prefill_block_m // group_pad)  # rows = block_q * group_pad >= 16
        grid = (triton.cdiv(plan.max_query_len, block_q), num_seqs, num_kv_heads)
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, block_tables, meta.context_lens, meta.query_start_loc,
            scale * LOG2E,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=pad_dim(head_dim), BLOCK_SIZE=block_size,
            BLOCK_N=self.tuning.prefill_block_n, **dot_settings(q.dtype),
            num_warps=self.tuning.prefill_num_warps,
        )
        return out
