"""Batch-invariant projections: y = x @ W^T (+ b) whose every row is computed the same way for every row count.

Why: cuBLAS picks its kernel (tile shape, split-K, reduction order) by M, and the GEMV / few-rows kernels of
kernels/gemv.py and kernels/skinny.py are chosen by M too (choose_gemv_tiles, choose_skinny_tiles; the few-rows
kernel also pads M to a power of two, which changes its tl.dot tile). So a request's hidden states change in the
last bit with the number of rows beside it, and in bf16 a greedy tie flips. Under --batch-invariant every
projection and the lm_head run through `invariant_linear` instead.

Algorithm (Triton, CUDA): a program owns BLOCK_N outputs of a tile of rows, computed transposed, as
acc [BLOCK_N, ROW_TILE] = W tile @ x tile^T: W's rows are the tensor-core MMA's rows and the activations' rows
its narrow side, so at one row the MMA multiplies 16 columns, not 64. K is cut into `splits` equal ranges, the
count chosen from N and K alone (`invariant_split`: enough programs to fill the GPU at one row tile, which a small
model's decode projections are not unsplit: 1024 outputs are 16 programs). Each split is summed from zero in
BLOCK_K steps, acc += tl.dot(W tile, x tile^T) in fp32, and the tile is split 0 + split 1 + ... in that order,
then the bias. Two launches compute exactly that:
  - parallel (the row tiles alone leave the GPU short of programs: decode): grid (N tiles, M tiles, splits);
    a program writes its split's fp32 partial tile and counts itself in; the last to arrive for a tile adds
    the partials in split order and stores (which program merges depends on timing, the order does not);
  - serial (enough row tiles: prefill): grid (N tiles, M tiles); a program sums its tile's splits one after
    another, with no partials in memory. The same fp32 operations in the same order, so which launch a row
    took, chosen by M, does not change its bits.
BLOCK_N, BLOCK_K, the warps, stages and split rule are one constant set (InvariantTiles) for every M, so an output
element's sums run over the same K steps in the same order in every launch, and a row's result depends on its own
values only (the MMA's columns are independent; padded rows are masked loads of 0 and never stored). Only the
row tile follows M (16 to 128 columns: the next power of two), and only a width of the same MMA, whose column
sums the GPU test and the benchmark check bit for bit at 1 to 1100 rows. The cost: a parallel launch writes and
reads its fp32 partials (splits x M x N, L2-sized), and no norm or activation folds into a projection. With PDL
(pdl=True) the kernel lets the next one launch first thing and, at up to 16 rows, loads its first weight tile
before its wait (weights are never written by a step): the timing changes, the arithmetic does not.

CPU (and a CUDA install without triton): torch's F.linear is not batch invariant in fp32 either (oneDNN and MKL
pick kernels by M), so `rowwise_linear` runs F.linear one row at a time: every row is then the same [1, K] call.
Slow, and meant for the CPU tests and the CPU oracle, not for speed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ostinato.errors import ConfigError
from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.kernels.split_counters import SplitCounters
from ostinato.kernels.triton_optional import jit, tl, triton  # noqa: F401  (tl: the kernel's annotations)

if triton is not None:  # the torch path needs none of these
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED, dot, dot_settings, rowwise_dot
    from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait


# The parallel-split launches' arrival counters (kernels/split_counters.py), shared by every projection: launches
# on one stream never overlap. A parallel launch has fewer than split_programs tiles, one counter each, within
# SplitCounters.MIN_COUNTERS at the default tiles: a capture never has to grow them.
ARRIVAL_COUNTERS = SplitCounters()


def _jit_any_m(fn):
    """triton.jit with M not specialised (Triton compiles M == 1 and M % 16 == 0 apart by default): one compiled
    kernel serves every row count."""
    return triton.jit(fn, do_not_specialize=["M"]) if triton is not None else fn


@_jit_any_m
def _invariant_gemm_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counters_ptr, M, N, K, stride_xm, stride_wn, stride_om, stride_ps,
    stride_pm, K_PER_SPLIT, SPLITS,
    ROW_TILE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PARALLEL: tl.constexpr, PREFETCH: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    ROWWISE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    # A program owns the output tile out[rows, cols]^T as acc [BLOCK_N, ROW_TILE]: W's rows are the MMA's rows, the
    # activations' rows its columns. Split s of a tile is the sum over K range [s * K_PER_SPLIT, (s + 1) *
    # K_PER_SPLIT) from zero; the tile is split 0 + split 1 + ... in that order. K_PER_SPLIT is a multiple of
    # BLOCK_K and SPLITS comes from (N, K) alone (invariant_split). PARALLEL: program (n, m, s) computes split s
    # and the last to arrive adds them up; else program (n, m) computes the splits one after another: the same
    # fp32 operations in the same order. PREFETCH: the split's first weight tile is loaded before the PDL wait
    # (weights are never written by a step): the same values into the same sums, only earlier.
    pdl_begin(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * ROW_TILE + tl.arange(0, ROW_TILE)
    n_mask = offs_n < N
    m_mask = offs_m < M
    tile_mask = n_mask[:, None] & m_mask[None, :]  # [BLOCK_N, ROW_TILE]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm  # [1, ROW_TILE]: x read transposed, [BLOCK_K, ROW_TILE]
    out_offsets = offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
    if PARALLEL:
        k_first = tl.program_id(2) * K_PER_SPLIT
    else:
        k_first = 0
    w_first = _weight_tile(w_rows, n_mask, k_first, K, BLOCK_K) if PREFETCH else None
    pdl_wait(PDL)
    if PARALLEL:
        pid_s = tl.program_id(2)
        acc = _split_dot(x_cols, w_rows, m_mask, n_mask, k_first, K_PER_SPLIT, K, w_first, ROW_TILE, BLOCK_N,
                         BLOCK_K, PREFETCH, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT)
        # Publish this split's partial, then count it in; the program that arrives last sums all the tile's
        # partials in split order (whoever arrives last, the order is the same), as the decode attention's
        # single-launch merge does (kernels/decode_attention.py says why barrier + acq_rel).
        parts = part_ptr + offs_m.to(tl.int64)[None, :] * stride_pm + offs_n[:, None]
        tl.store(parts + pid_s.to(tl.int64) * stride_ps, acc, mask=tile_mask)
        tl.debug_barrier()
        counter = counters_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            tl.debug_barrier()
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
            total = tl.load(parts, mask=tile_mask, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLITS):
                total += tl.load(parts + s * stride_ps, mask=tile_mask, other=0.0, cache_modifier=".cg")
            _store_tile(total, b_ptr, out_ptr, offs_n, n_mask, tile_mask, out_offsets, HAS_BIAS)
    else:
        acc = _split_dot(x_cols, w_rows, m_mask, n_mask, 0, K_PER_SPLIT, K, w_first, ROW_TILE, BLOCK_N, BLOCK_K,
                         PREFETCH, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT)
        for s in range(1, SPLITS):
            acc += _split_dot(x_cols, w_rows, m_mask, n_mask, s * K_PER_SPLIT, K_PER_SPLIT, K, w_first, ROW_TILE,
                              BLOCK_N, BLOCK_K, False, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT)
        _store_tile(acc, b_ptr, out_ptr, offs_n, n_mask, tile_mask, out_offsets, HAS_BIAS)


@jit
def _weight_tile(w_rows, n_mask, k0, k_end, BLOCK_K: tl.constexpr):
    """W[offs_n, k0:k0 + BLOCK_K] as [BLOCK_N, BLOCK_K], zeros past k_end and N."""
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & (ks < k_end)[None, :], other=0.0)


@jit
def _split_dot(x_cols, w_rows, m_mask, n_mask, k_start, K_PER_SPLIT, K, w_first, ROW_TILE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_FIRST: tl.constexpr, DOT_PRECISION: tl.constexpr,
               UPCAST_DOT: tl.constexpr, ROWWISE_DOT: tl.constexpr):
    """One split's [BLOCK_N, ROW_TILE] fp32 sum over K range [k_start, k_start + K_PER_SPLIT), from zero, one
    BLOCK_K tile after another. HAS_FIRST: w_first is the split's first weight tile, already loaded."""
    offs_k = tl.arange(0, BLOCK_K)
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_N, ROW_TILE], tl.float32)
    k_loop = k_start
    if HAS_FIRST:
        acc = _tile_step(acc, w_first, x_cols, m_mask, k_start + offs_k, k_end, DOT_PRECISION, UPCAST_DOT,
                         ROWWISE_DOT)
        k_loop = k_start + BLOCK_K
    for k0 in range(k_loop, k_end, BLOCK_K):
        w = _weight_tile(w_rows, n_mask, k0, k_end, BLOCK_K)
        acc = _tile_step(acc, w, x_cols, m_mask, k0 + offs_k, k_end, DOT_PRECISION, UPCAST_DOT, ROWWISE_DOT)
    return acc


@jit
def _tile_step(acc, w, x_cols, m_mask, ks, k_end, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
               ROWWISE_DOT: tl.constexpr):
    """acc + w [BLOCK_N, BLOCK_K] @ x[:, ks]^T [BLOCK_K, ROW_TILE]."""
    x_t = tl.load(x_cols + ks[:, None], mask=(ks < k_end)[:, None] & m_mask[None, :], other=0.0)
    if ROWWISE_DOT:  # the interpreter (attention_common.rowwise_dot)
        return acc + rowwise_dot(w, x_t)
    return acc + dot(w, x_t, DOT_PRECISION, UPCAST_DOT)


@jit
def _store_tile(acc, b_ptr, out_ptr, offs_n, n_mask, tile_mask, out_offsets, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, ROW_TILE] (+ bias) stored as out[rows, cols]."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


@dataclass(frozen=True)
class InvariantTiles:
    """The one tiling of every batch-invariant launch (powers of two >= 16). Changing block_n, block_k or the
    split fields changes the reduction order, so they are constants, never chosen per call.

    block_n, block_k: weight rows a program owns (the MMA's row side) and the K step.
    min_row_tile, max_row_tile: a program takes the activations' rows in tiles of the next power of two of the
        row count, between these two (the MMA's narrow side): at one row the tensor cores multiply 16 columns
        instead of 64, and prefill's tiles of 128 rows read each weight tile half as often as tiles of 64. Each output column is the same chain of BLOCK_K steps at every width (the K order never
        depends on it); that a tensor-core column's bits do not depend on the MMA's width is checked on the GPU
        (tests/kernels/test_batch_invariant_kernels.py, `-m gpu`; benchmarks/kernels/invariant_linear.py).
    prefetch_max_rows: up to this many rows the first weight tile is loaded before the PDL wait, overlapping the
        kernel before (the same values, only earlier); at 64 rows it measured slower.
    split_programs: the K range is split so that cdiv(N, block_n) x splits reaches about this many programs
        at one row tile (`invariant_split`): a decode projection of a small model has few N tiles (1024 outputs:
        16 programs for a GPU of 132 SMs), and unsplit each walks all of K alone. The split depends on N and K,
        never on M, so a row's partial sums and their order are the same in every batch.
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


INVARIANT_TILES = InvariantTiles()


def invariant_split(n: int, k: int, tiles: InvariantTiles = INVARIANT_TILES) -> tuple[int, int]:
    """(splits, keys per split) of the K range of an [N, K] weight: from N, K and the constant tiles only."""
    n_tiles = -(-n // tiles.block_n)
    k_tiles = max(1, -(-k // tiles.block_k))
    wanted = max(1, min(k_tiles, tiles.split_programs // n_tiles))
    per_split = max(-(-k_tiles // wanted), tiles.min_split_k_tiles)  # whole K tiles: then no split is empty
    return -(-k_tiles // per_split), per_split * tiles.block_k


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, tiles: InvariantTiles = INVARIANT_TILES,
                   pdl: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous), weight [N, K] contiguous, bias [N] or None -> [M, N] in out_dtype (default x's),
    accumulated in fp32, each row by the same arithmetic for every M. Graph safe: grid from shapes only.
    pdl: launch with programmatic dependent launch (kernels/pdl.py; launch timing only, the same arithmetic).
    Under TRITON_INTERPRET (CPU tests) the K step is attention_common.rowwise_dot instead of tl.dot."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous()
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0:
        return out
    splits, per_split = invariant_split(n, k, tiles)
    row_tile = tiles.row_tile(m)
    n_tiles, m_tiles = triton.cdiv(n, tiles.block_n), triton.cdiv(m, row_tile)
    # Splits in parallel only where the row tiles alone leave the GPU short of programs (decode): then the fp32
    # partials are at most splits x split_programs tiles, and the counters fewer than split_programs.
    parallel = splits > 1 and n_tiles * m_tiles < tiles.split_programs
    b = bias if bias is not None else weight  # unread without a bias
    if parallel:
        partials = torch.empty(splits, m, n, device=x.device, dtype=torch.float32)
        counters = ARRIVAL_COUNTERS.get(x.device, n_tiles * m_tiles)
    else:
        partials = counters = out  # unread
    _invariant_gemm_kernel[(n_tiles, m_tiles, splits if parallel else 1)](
        x, weight, b, out, partials, counters, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        partials.stride(0), partials.stride(1), per_split, splits,
        ROW_TILE=row_tile, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
        PARALLEL=parallel, PREFETCH=m <= tiles.prefetch_max_rows, **dot_settings(x.dtype),
        ROWWISE_DOT=KERNELS_INTERPRETED, PDL=pdl, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(pdl))
    return out


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear one row at a time, [M, K] -> [M, N]: every row the same [1, K] call, whatever M (the torch
    path's invariant linear; see the module docstring)."""
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])


def _check_layer(layer: torch.nn.Module) -> None:
    tp = getattr(layer, "tp", None)
    if isinstance(layer, QuantizedLinear):
        raise ConfigError("--batch-invariant supports unquantized checkpoints only: a quantized projection picks "
                          "its kernel by row count; drop --batch-invariant or load a bf16/fp16/fp32 checkpoint")
    if tp is not None and tp.world_size > 1:
        raise ConfigError("--batch-invariant needs --tensor-parallel-size 1")


def gemm_linear(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False) -> torch.Tensor:
    """layer(x) through invariant_gemm (the batch-invariant Triton kernel set's linear)."""
    _check_layer(layer)
    return invariant_gemm(x if x.stride(-1) == 1 else x.contiguous(), layer.weight, layer.bias, pdl=pdl)


def rowwise_layer_linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """layer(x) through rowwise_linear (the batch-invariant torch kernel set's linear)."""
    _check_layer(layer)
    return rowwise_linear(x, layer.weight, layer.bias)


def gemm_logits(hidden: torch.Tensor, weight: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """hidden [M, K] @ weight^T -> fp32 logits [M, V] through invariant_gemm: 16-bit operands, fp32 accumulation
    and output, never rounded to 16 bits (model/decoder.py's compute_logits says why)."""
    return invariant_gemm(hidden if hidden.stride(-1) == 1 else hidden.contiguous(), weight, out_dtype=torch.float32,
                          pdl=pdl)


def rowwise_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gemm_logits on the torch path: fp32 rows one at a time (16-bit values are exact in fp32)."""
    return rowwise_linear(hidden.float(), weight.float())
