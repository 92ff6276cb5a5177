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
    reduce    grid (num_seqs, num_heads): merges the active slices' (max, sum, unnormalised output). With
              num_splits == 1 the split kernel normalises and writes the output itself: no reduce launch.

Choosing num_splits (choose_num_splits): from shapes only (batch, kv heads, block-table width, SM count),
so it is fixed before a graph is captured and never changes during replays. A batch whose own programs
(num_seqs * num_kv_heads) already cover every SM is not split (no reduce kernel); a smaller one is split
until the GPU holds `programs_per_sm` programs per SM, but no further than one BLOCK_N tile per slice of
the widest context the table can hold, nor than max_splits. On an H200 (132 SMs) with 8 kv heads, batch 1
splits 32 ways at a 2048-token table (64 at 32k), batch 16 5 ways, batch >= 17 not at all; except that a
table wider than max_keys_per_program (2048) tokens always splits so that no program scans more (batch 64
at an 8448-token table: 5 ways), since one long sequence would otherwise straggle.

Why not fixed-size partitions (the kernel this replaced): a partition of 256 tokens gave batch 1 at context
512 only 2 partitions x 8 kv heads = 16 programs for 132 SMs, each looping over 256 tokens; and the
partition count came from the table width (the max model length), so a batch of 64 launched
programs for every partition of a 2048-token table, most of them empty, plus a reduce.

Limits: as attention/triton_paged.py (any head_dim, padded; block_size any; fp32/bf16/fp16). Run once
before capture so that Triton compiles outside it (the runner's warm-up does).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from .triton_common import KERNELS_INTERPRETED, LOG2E, dot, dot_settings, pad_dim, paged_kv_offsets


@triton.jit
def _split_span(context_len, num_splits, BLOCK_N: tl.constexpr):
    """Tokens per slice for this context: cdiv(context, num_splits) up to a multiple of BLOCK_N (>= BLOCK_N,
    so a context of 0 has a span and no active slice)."""
    span = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    return tl.maximum(span, BLOCK_N)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale_log2e, num_splits,
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cache_block, stride_cache_tok, stride_cache_head, stride_bt,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    # num_splits is a run-time argument (one compiled kernel for every split count); SPLIT = num_splits > 1.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    span = _split_span(context_len, num_splits, BLOCK_N)
    start = split * span
    if SPLIT:
        if start >= context_len:
            return  # an inactive slice: the reduce reads only the active ones
    end = tl.minimum(start + span, context_len)

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
        if HEAD_DIM == HEAD_DIM_PAD:
            kv_mask = n_mask[:, None]  # no padded columns: a row mask keeps the loads 16 bytes wide
        else:
            kv_mask = n_mask[:, None] & d_mask[None, :]
        kv_offs = paged_kv_offsets(block_tables_ptr, seq * stride_bt, toks, n_mask, kv_head,
                                   stride_cache_block, stride_cache_tok, stride_cache_head, BLOCK_SIZE)
        tile = kv_offs[:, None] + offs_d[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        k = tl.load(k_cache_ptr + tile, mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + tile, mask=kv_mask, other=0.0)
        s = dot(q, tl.trans(k), DOT_PRECISION, UPCAST_DOT) * scale_log2e  # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_PRECISION, UPCAST_DOT)
        m_i = m_new

    if not SPLIT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # context 0 -> zeros, not NaN
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    else:
        # Partials: [num_seqs, NUM_HEADS, num_splits] (+ [HEAD_DIM_PAD] for the output), contiguous.
        part_idx = (seq * NUM_HEADS + heads) * num_splits + split  # [GROUP_PAD]
        tl.store(part_max_ptr + part_idx, m_i, mask=g_mask)
        tl.store(part_sum_ptr + part_idx, l_i, mask=g_mask)
        tl.store(part_out_ptr + part_idx[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=g_mask[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, context_lens_ptr,
    num_splits, stride_os, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    context_len = tl.load(context_lens_ptr + seq)
    num_active = tl.cdiv(context_len, _split_span(context_len, num_splits, BLOCK_N))  # slices that wrote
    base = (seq * NUM_HEADS + head) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < num_active
    m_s = tl.load(part_max_ptr + base + offs_s, mask=s_mask, other=float("-inf"))  # [SPLITS_PAD]
    l_s = tl.load(part_sum_ptr + base + offs_s, mask=s_mask, other=0.0)
    o_s = tl.load(part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
                  mask=s_mask[:, None], other=0.0)  # [SPLITS_PAD, HEAD_DIM_PAD]
    m_max = tl.max(m_s, 0)
    m_max = tl.where(num_active > 0, m_max, 0.0)  # context 0: every weight exp2(-inf) = 0, not NaN
    w = tl.exp2(m_s - m_max)
    total = tl.sum(l_s * w, 0)
    out = tl.sum(o_s * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class DecodeTuning:
    """Launch settings of the decode kernels. The defaults were the fastest of a sweep (block_n 32/64,
    num_stages 1/3, programs_per_sm 2/4) on the H200 at batch 1, 16, 64 (docs/PERFORMANCE.md, issue 11).

    block_n: tokens per inner-loop tile (a power of two >= 16).
    programs_per_sm: split until num_seqs * num_kv_heads * splits reaches this many programs per SM.
    max_splits: at most this many slices (bounds the reduce's work and the partials' memory).
    max_keys_per_program: split a table wider than this many tokens at any batch (a long sequence's scan
    must not set the step's time; choose_num_splits).
    splits: force this split count for every shape (tests, measurements); None chooses per shape.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int = 4
    max_splits: int = 64
    max_keys_per_program: int = 2048
    splits: int | None = None

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ConfigError(f"decode block_n must be a power of two >= 16, got {self.block_n}")
        for name in ("num_warps", "num_stages", "programs_per_sm", "max_splits", "max_keys_per_program"):
            if getattr(self, name) < 1:
                raise ConfigError(f"decode {name} must be >= 1, got {getattr(self, name)}")
        if self.splits is not None and self.splits < 1:
            raise ConfigError(f"decode splits must be >= 1 or None, got {self.splits}")


def choose_num_splits(tuning: DecodeTuning, num_seqs: int, num_kv_heads: int, max_context: int,
                      num_sms: int) -> int:
    """Slices per sequence for a decode launch; shapes only (see the module docstring)."""
    if tuning.splits is not None:
        return tuning.splits
    programs = max(1, num_seqs * num_kv_heads)
    # One long sequence among short ones: unsplit, its programs scan its whole context while the rest of the
    # GPU idles, and the step waits for them (H200, llama-3.1-8b shape, 32 rows at context 256 beside one at
    # 8192: +6.5 ms a step). So no program gets more than max_keys_per_program keys of the widest context
    # the table holds, even when the batch alone fills the GPU.
    straggler = triton.cdiv(max(max_context, 1), tuning.max_keys_per_program)
    if programs >= num_sms:
        return max(1, min(straggler, tuning.max_splits))
    wanted = max(triton.cdiv(tuning.programs_per_sm * num_sms, programs), straggler)
    useful = triton.cdiv(max(max_context, 1), tuning.block_n)  # more slices than tiles would all be empty
    return max(1, min(wanted, useful, tuning.max_splits))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter on CPU: a small pretend GPU, so CPU tests split small batches too
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, group: int, tuning: DecodeTuning) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] (head_dim contiguous) -> out, same shape. CUDA-graph safe: no host
    sync, and every allocation and the grid depend on shapes only."""
    num_seqs, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    splits = choose_num_splits(tuning, num_seqs, num_kv_heads, block_tables.shape[1] * block_size,
                               _num_sms(q.device))
    head_dim_pad = pad_dim(head_dim)
    if splits > 1:
        # Sized by shapes only, so allocating here is fine inside a CUDA-graph capture (graph pool).
        part_out = torch.empty(num_seqs, num_heads, splits, head_dim_pad, device=q.device, dtype=torch.float32)
        part_max = torch.empty(num_seqs, num_heads, splits, device=q.device, dtype=torch.float32)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out  # unused: the kernel writes `out` directly
    _decode_split_kernel[(num_seqs, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_out, part_max, part_sum,
        scale * LOG2E, splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=pad_dim(group),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_SIZE=block_size, BLOCK_N=tuning.block_n,
        SPLIT=splits > 1, **dot_settings(q.dtype),
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
    if splits > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, context_lens,
            splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_N=tuning.block_n,
            SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out


