"""y = x @ W^T (+ b) on the tensor cores with the weight on the MMA's wide side and K split over programs, each
output summed in one fixed order: the batch-invariant projections' GEMM (kernels/invariant_linear.py) and FP8
weights' projections at decode rows (kernels/fp8_linear.py): W8A16, or W8A8 on activations quantized per token.

Why this shape of kernel: at decode a projection has few rows and a weight far larger than L2, so the time is the
weight read, and what matters is that every SM keeps loads in flight. A GEMM tile with the rows on the MMA's
64-row side multiplies 63 padded rows for each real one at one row, and a narrow projection unsplit makes few
programs (1024 outputs in 64-wide tiles: 16 programs for 132 SMs).

Algorithm (Triton, CUDA): a program owns BLOCK_N outputs of a tile of rows, computed transposed, as
acc [BLOCK_N, ROW_TILE] = W tile @ x tile^T: W's rows are the tensor-core MMA's rows and the activations' rows
its narrow side, ROW_TILE the next power of two of the row count between the tiles' bounds (16 columns at one
row). K is cut into `splits` equal ranges, the count from N and K alone (`SplitTiles.split`: enough programs to
fill the GPU at one row tile). Each split is summed from zero in BLOCK_K steps, acc += tl.dot(W tile, x tile^T)
in fp32, and the tile is split 0 + split 1 + ... in that order, then times each weight row's scale (FP8
weights, widened to the activations' dtype in registers: W8A16), then the bias. Block-scaled FP8 weights multiply
each K step's products by the step's block scales instead (BLOCK_K divides the block's width, so a step lies in
one block). Two launches compute exactly that:
  - parallel (the row tiles alone leave the GPU short of programs: decode): grid (N tiles, M tiles, splits);
    a program writes its split's fp32 partial tile and counts itself in; the last to arrive for a tile adds
    the partials in split order and stores (which program merges depends on timing, the order does not);
  - serial (enough row tiles: prefill): grid (N tiles, M tiles); a program sums its tile's splits one after
    another, with no partials in memory. The same fp32 operations in the same order, so which launch a row
    took, chosen by M, does not change its bits.
With PDL (pdl=True) the kernel lets the next one launch first thing and, up to prefetch_max_rows rows, loads its
first weight tile before its wait (weights are never written by a step): the timing changes, the arithmetic does
not. Under TRITON_INTERPRET (CPU tests) the K step is attention_common.rowwise_dot instead of tl.dot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.fp8_gemv import fp8_scale_shape
from ostinato.kernels.split_counters import SplitCounters
from ostinato.kernels.triton_optional import jit, tl, triton  # noqa: F401  (tl: the kernel's annotations)

if triton is not None:
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED, dot, dot_settings, rowwise_dot
    from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait


# The parallel-split launches' arrival counters (kernels/split_counters.py), shared by every projection: launches
# on one stream never overlap. A parallel launch has fewer than split_programs tiles, one counter each, within
# SplitCounters.MIN_COUNTERS at the tiles in use: a capture never has to grow them.
ARRIVAL_COUNTERS = SplitCounters()


def jit_any_m(fn):
    """triton.jit with M not specialised (Triton compiles M == 1 and M % 16 == 0 apart by default): one compiled
    kernel serves every row count of a row tile."""
    return triton.jit(fn, do_not_specialize=["M"]) if triton is not None else fn


@jit_any_m
def _split_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, s_ptr, b_ptr, out_ptr, part_ptr, counters_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
    stride_om, stride_ps, stride_pm, K_PER_SPLIT, SPLITS,
    ROW_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_X_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, PARALLEL: tl.constexpr, PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr, ROWWISE_DOT: tl.constexpr, PDL: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
):
    # A program owns the output tile out[rows, cols]^T as acc [BLOCK_N, ROW_TILE]: W's rows are the MMA's rows, the
    # activations' rows its columns. Split s of a tile is the sum over K range [s * K_PER_SPLIT, (s + 1) *
    # K_PER_SPLIT) from zero; the tile is split 0 + split 1 + ... in that order. K_PER_SPLIT is a multiple of
    # BLOCK_K and SPLITS comes from (N, K) alone (SplitTiles.split). PARALLEL: program (n, m, s) computes split s
    # and the last to arrive adds them up; else program (n, m) computes the splits one after another: the same
    # fp32 operations in the same order. PREFETCH: the split's first weight tile is loaded before the PDL wait
    # (weights are never written by a step): the same values into the same sums, only earlier. BLOCK_SCALES: each
    # K step's products times its [BLOCK_N] block scales (a step never crosses a block: SCALE_BK % BLOCK_K == 0).
    # HAS_X_SCALE: x holds FP8 codes, row m times xs[m] (W8A8: the tensor cores multiply E4M3 by E4M3, nothing widened).
    pdl_begin(PDL)
    offs_n, offs_m, n_mask, m_mask, tile_mask = tile_offsets(N, M, BLOCK_N, ROW_TILE)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, ROW_TILE]: x read transposed, [BLOCK_K, ROW_TILE]
    out_offsets = offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    s_rows = s_ptr + (tl.minimum(offs_n, N - 1) // SCALE_BN) * stride_sn  # [BLOCK_N]: read with BLOCK_SCALES only
    pid_s = tl.program_id(2)  # the split; always 0 in the serial launch
    k_first = pid_s * K_PER_SPLIT
    w_first = _weight_tile(w_rows, n_mask, k_first, K, BLOCK_K) if PREFETCH else None
    pdl_wait(PDL)
    if PARALLEL:
        acc = _split_dot(x_cols, w_rows, s_rows, m_mask, n_mask, k_first, K_PER_SPLIT, K, w_first, ROW_TILE,
                         BLOCK_N, BLOCK_K, PREFETCH, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT, BLOCK_SCALES, SCALE_BK)
        last, total = merge_splits(acc, part_ptr, counters_ptr, offs_m, offs_n, tile_mask, stride_ps, stride_pm,
                                   SPLITS)
        if last:
            _store_tile(total, s_ptr, xs_ptr, b_ptr, out_ptr, offs_n, n_mask, offs_m, m_mask, tile_mask, out_offsets,
                        HAS_SCALE, HAS_X_SCALE, HAS_BIAS)
    else:
        acc = _split_dot(x_cols, w_rows, s_rows, m_mask, n_mask, 0, K_PER_SPLIT, K, w_first, ROW_TILE, BLOCK_N,
                         BLOCK_K, PREFETCH, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT, BLOCK_SCALES, SCALE_BK)
        for s in range(1, SPLITS):
            acc += _split_dot(x_cols, w_rows, s_rows, m_mask, n_mask, s * K_PER_SPLIT, K_PER_SPLIT, K, w_first,
                              ROW_TILE, BLOCK_N, BLOCK_K, False, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT, BLOCK_SCALES,
                              SCALE_BK)
        _store_tile(acc, s_ptr, xs_ptr, b_ptr, out_ptr, offs_n, n_mask, offs_m, m_mask, tile_mask, out_offsets,
                    HAS_SCALE, HAS_X_SCALE, HAS_BIAS)


@jit
def tile_offsets(N, M, BLOCK_N: tl.constexpr, ROW_TILE: tl.constexpr):
    """Program (n, m)'s output tile out[rows, cols]^T: its W rows and x rows (offs_n, offs_m), their masks, and
    the tile's mask [BLOCK_N, ROW_TILE]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * ROW_TILE + tl.arange(0, ROW_TILE)
    n_mask = offs_n < N
    m_mask = offs_m < M
    return offs_n, offs_m, n_mask, m_mask, n_mask[:, None] & m_mask[None, :]


@jit
def merge_splits(acc, part_ptr, counters_ptr, offs_m, offs_n, tile_mask, stride_ps, stride_pm, SPLITS):
    """(whether this program arrived last, the tile's sum): this split's partial acc [BLOCK_N, ROW_TILE] published
    at part_ptr [splits, M, N] (fp32), then counted in at the tile's counter; the program that arrives last adds
    all the tile's partials in split order (whoever arrives last, the order is the same), as the decode
    attention's single-launch merge does (kernels/decode_attention.py says why barrier + acq_rel). Other
    programs get their own acc back, not to be stored."""
    parts = part_ptr + offs_m.to(tl.int64)[None, :] * stride_pm + offs_n[:, None]
    tl.store(parts + tl.program_id(2).to(tl.int64) * stride_ps, acc, mask=tile_mask)
    tl.debug_barrier()
    counter = counters_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = arrived == SPLITS - 1
    total = acc
    if last:
        tl.debug_barrier()
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
        total = tl.load(parts, mask=tile_mask, other=0.0, cache_modifier=".cg")
        for s in range(1, SPLITS):
            total += tl.load(parts + s * stride_ps, mask=tile_mask, other=0.0, cache_modifier=".cg")
    return last, total


@jit
def _weight_tile(w_rows, n_mask, k0, k_end, BLOCK_K: tl.constexpr):
    """W[offs_n, k0:k0 + BLOCK_K] as [BLOCK_N, BLOCK_K], zeros past k_end and N."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < k_end)[None, :], other=0.0)


@jit
def _split_dot(x_cols, w_rows, s_rows, m_mask, n_mask, k_start, K_PER_SPLIT, K, w_first, ROW_TILE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
               UPCAST_DOT: tl.constexpr, ROWWISE_DOT: tl.constexpr, BLOCK_SCALES: tl.constexpr,
               SCALE_BK: tl.constexpr):
    """One split's [BLOCK_N, ROW_TILE] fp32 sum over K range [k_start, k_start + K_PER_SPLIT), from zero, one
    BLOCK_K tile after another (each times its block scales s_rows[k0 // SCALE_BK] with BLOCK_SCALES). HAS_FIRST:
    w_first is the split's first weight tile, already loaded."""
    offs_k = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_N, ROW_TILE], tl.float32)
    k_loop = k_start
    if HAS_FIRST:
        acc = _tile_step(acc, w_first, x_cols, s_rows, m_mask, k_start, offs_k, k_end, DOT_PRECISION, UPCAST_DOT,
                         ROWWISE_DOT, BLOCK_SCALES, SCALE_BK)
        k_loop = k_start + BLOCK_K
    for k0 in range(k_loop, k_end, BLOCK_K):
        w = _weight_tile(w_rows, n_mask, k0, k_end, BLOCK_K)
        acc = _tile_step(acc, w, x_cols, s_rows, m_mask, k0, offs_k, k_end, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT,
                         BLOCK_SCALES, SCALE_BK)
    return acc


@jit
def _tile_step(acc, w, x_cols, s_rows, m_mask, k0, offs_k, k_end, DOT_PRECISION: tl.constexpr,
               UPCAST_DOT: tl.constexpr, ROWWISE_DOT: tl.constexpr, BLOCK_SCALES: tl.constexpr,
               SCALE_BK: tl.constexpr):
    """acc + w [BLOCK_N, BLOCK_K] @ x[:, k0 + offs_k]^T [BLOCK_K, ROW_TILE]; w widened to x's dtype first (FP8
    weights, W8A16: per-row scales multiply the sums at the end, block scales each step's products)."""
    ks = k0 + offs_k
    x_t = tl.load(x_cols + ks[:, None], mask=(ks < k_end)[:, None] & m_mask[None, :], other=0.0)
    w = w.to(x_t.dtype)
    if ROWWISE_DOT:  # the interpreter (attention_common.rowwise_dot)
        product = rowwise_dot(w, x_t)
    else:
        product = dot(w, x_t, DOT_PRECISION, UPCAST_DOT)
    if BLOCK_SCALES:
        return acc + product * tl.load(s_rows + k0 // SCALE_BK)[:, None]
    return acc + product


@jit
def _store_tile(acc, s_ptr, xs_ptr, b_ptr, out_ptr, offs_n, n_mask, offs_m, m_mask, tile_mask, out_offsets,
                HAS_SCALE: tl.constexpr, HAS_X_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, ROW_TILE] (x each weight row's scale) (x each x row's scale) (+ bias) stored as out[rows, cols]."""
    if HAS_SCALE:
        acc *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[:, None]
    if HAS_X_SCALE:
        acc *= tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


@dataclass(frozen=True)
class SplitTiles:
    """A split GEMM's tiling (powers of two >= 16).

    block_n, block_k: weight rows a program owns (the MMA's row side) and the K step.
    min_row_tile, max_row_tile: a program takes the activations' rows in tiles of the next power of two of the
        row count, between these two (the MMA's narrow side).
    prefetch_max_rows: up to this many rows the first weight tile is loaded before the PDL wait, overlapping the
        kernel before (the same values, only earlier).
    split_programs: the K range is split so that cdiv(N, block_n) x splits reaches about this many programs
        at one row tile (`split`). The split depends on N and K, never on M.
    min_split_k_tiles: a split spans at least this many K tiles: where the row tiles fill the GPU (prefill), a
        program walks its splits one after another, each a loop of its own, and a loop of one or two tiles
        never gets the num_stages pipeline going.
    """

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    split_programs: int = 256
    min_split_k_tiles: int = 4
    min_row_tile: int = 16
    max_row_tile: int = 128
    prefetch_max_rows: int = 16

    def row_tile(self, m: int) -> int:
        return min(self.max_row_tile, max(self.min_row_tile, triton.next_power_of_2(m)))

    def split(self, n: int, k: int) -> tuple[int, int]:
        """(splits, keys per split) of the K range of an [N, K] weight: from N, K and the tiles only."""
        splits, per_split = split_steps(-(-n // self.block_n), max(1, -(-k // self.block_k)), self.split_programs,
                                        self.min_split_k_tiles)
        return splits, per_split * self.block_k


def split_steps(n_tiles: int, steps: int, split_programs: int, min_per_split: int) -> tuple[int, int]:
    """(splits, K steps a split) of a K range of `steps` steps: enough splits that n_tiles tiles make about
    split_programs programs, each split whole steps (then none is empty) and at least min_per_split of them."""
    wanted = max(1, min(steps, split_programs // n_tiles))
    per_split = max(-(-steps // wanted), min_per_split)
    return -(-steps // per_split), per_split


def split_buffers(out: torch.Tensor, splits: int, n_tiles: int, m_tiles: int, split_programs: int,
                  ) -> tuple[bool, torch.Tensor, torch.Tensor]:
    """(parallel, partials, counters) of a split launch writing out [M, N]. Splits in parallel only where the row
    tiles alone leave the GPU short of programs (decode): then the fp32 partials are at most splits x
    split_programs tiles, and the counters fewer than split_programs. Serial launches read neither (out stands in)."""
    if splits > 1 and n_tiles * m_tiles < split_programs:
        partials = torch.empty(splits, *out.shape, device=out.device, dtype=torch.float32)
        return True, partials, ARRIVAL_COUNTERS.get(out.device, n_tiles * m_tiles)
    return False, out, out


def split_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: SplitTiles,
               scale: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
               pdl: bool = False, block: tuple[int, int] | None = None,
               x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (K contiguous), weight [N, K] contiguous (x's dtype, or FP8 with `scale`: float32 [N], W[n] =
    weight[n] * scale[n], or with `block` (bn, bk) [cdiv(N, bn), cdiv(K, bk)], each block of W its own; bk a
    multiple of tiles.block_k), bias [N] or None -> [M, N] in out_dtype (default x's), accumulated in fp32.
    x_scale (float32, M values): x holds FP8 codes, x[m] = codes[m] * x_scale[m] (W8A8, per-row weight scales,
    kernels/fp8_tokens.quantize_tokens makes both). Graph safe: grid from shapes only. pdl: launch with programmatic
    dependent launch (kernels/pdl.py)."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous()
    assert x_scale is None or (x_scale.numel() == m and x_scale.is_contiguous() and x.dtype == weight.dtype
                               and block is None and out_dtype is not None)
    assert scale is None or (scale.shape == fp8_scale_shape(n, k, block) and scale.is_contiguous())
    assert block is None or (scale is not None and block[1] % tiles.block_k == 0)
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0:
        return out
    splits, per_split = tiles.split(n, k)
    row_tile = tiles.row_tile(m)
    n_tiles, m_tiles = triton.cdiv(n, tiles.block_n), triton.cdiv(m, row_tile)
    parallel, partials, counters = split_buffers(out, splits, n_tiles, m_tiles, tiles.split_programs)
    unread = weight  # stands in for the pointers a constexpr turns off
    _split_gemm_kernel[(n_tiles, m_tiles, splits if parallel else 1)](
        x, x_scale if x_scale is not None else unread, weight, scale if scale is not None else unread,
        bias if bias is not None else unread, out, partials, counters, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block is not None else 1, out.stride(0), partials.stride(0), partials.stride(1), per_split,
        splits, ROW_TILE=row_tile, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        HAS_SCALE=scale is not None and block is None, HAS_X_SCALE=x_scale is not None, HAS_BIAS=bias is not None,
        PARALLEL=parallel, BLOCK_SCALES=block is not None, SCALE_BN=block[0] if block is not None else 1,
        SCALE_BK=block[1] if block is not None else 1,
        PREFETCH=m <= tiles.prefetch_max_rows, **dot_settings(x.dtype), ROWWISE_DOT=KERNELS_INTERPRETED, PDL=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(pdl))
    return out
