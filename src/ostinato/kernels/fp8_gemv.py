"""The W8A16 GEMV for FP8 (E4M3) weights at a few rows: y = x @ (W_fp8 * scale)^T (+ b), fp32 accumulation.

Why it differs from the bf16 GEMV (kernels/gemv.py) it follows: at one row the step is bound by the bytes in
flight per SM (HBM latency times bandwidth), not by the accumulator. A [BLOCK_N, BLOCK_K] tile of one-byte
weights holds half the bytes of the same bf16 tile, so with the bf16 GEMV's tiles the FP8 one reads about as
many weights a second as bf16 does, not twice as many bytes' worth. K_TILES (1 or 2) loads that many
consecutive K tiles each loop step: twice the bytes in flight for the same [M_PAD, BLOCK_N, BLOCK_K] fp32
accumulator, so registers (and resident programs) stay as the bf16 GEMV's.

Loads carry no masks where the shapes do not need them: rows past N and M are clamped onto the last row (read
twice, stored never) instead of masked, and K is masked only when it is not a multiple of a loop step (EVEN_K).
Per-row scales multiply the sums once at the end; block scales multiply each weight tile as it loads (a gather
from the small scale table, which stays in cache). The first step's weight tiles are requested before the PDL
wait: weights are never written by a step (kernels/pdl.py's contract). One kernel per call, grid from shapes
only: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)


def fp8_scale_shape(n: int, k: int, block: tuple[int, int] | None) -> tuple[int, ...]:
    """The float32 scale table of an FP8 [N, K] weight: per row [N], or per block (bn, bk) [cdiv(N, bn),
    cdiv(K, bk)]."""
    return (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))


@dataclass(frozen=True)
class Fp8Tiles:
    """block_n outputs by block_k inputs per K tile of the FP8 GEMV; k_tiles tiles loaded per loop step."""

    block_n: int
    block_k: int
    num_warps: int = 4
    k_tiles: int = 1
    num_stages: int = 3


@_jit
def program_rows(w_ptr, N, stride_wn, BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """A few-rows program's indices: its outputs offs_n, the rows offs_m, the K tile's offs_k, the weight rows
    clamped in bounds (rows_n: read without a mask, the duplicates never stored) and their pointers [BLOCK_N, 1]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_n = tl.minimum(offs_n, N - 1)
    w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn
    return offs_n, tl.arange(0, M_PAD), tl.arange(0, BLOCK_K), rows_n, w_rows


@_jit
def _w_tile(w_rows, ks, K, EVEN_K: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] fp8 weight tile at columns ks (rows already clamped in bounds)."""
    if EVEN_K:
        return tl.load(w_rows + ks[None, :])
    return tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)


@_jit
def _products(x_rows, s_ptr, w, ks, K, offs_n, stride_sn, EVEN_K: tl.constexpr, BLOCK_SCALES: tl.constexpr,
              SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr):
    """x[:, ks] times the weight tile w (block-scaled first, with BLOCK_SCALES): [M_PAD, BLOCK_N, BLOCK_K] fp32."""
    wf = w.to(tl.float32)
    if BLOCK_SCALES:
        wf = wf * tl.load(s_ptr + (offs_n // SCALE_BN)[:, None] * stride_sn + (ks // SCALE_BK)[None, :],
                          mask=(ks < K)[None, :], other=0.0)
    if EVEN_K:
        x = tl.load(x_rows + ks[None, :]).to(tl.float32)
    else:
        x = tl.load(x_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0).to(tl.float32)
    return x[:, None, :] * wf[None, :, :]


@_jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_TILES: tl.constexpr,
    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    offs_n, offs_m, offs_k, rows_n, w_rows = program_rows(w_ptr, N, stride_wn, BLOCK_N, M_PAD, BLOCK_K)
    x_rows = x_ptr + tl.minimum(offs_m, M - 1)[:, None] * stride_xm
    w0 = _w_tile(w_rows, offs_k, K, EVEN_K)
    w1 = w0
    if K_TILES == 2:
        w1 = _w_tile(w_rows, offs_k + BLOCK_K, K, EVEN_K)
    pdl_wait(PDL)
    acc = _products(x_rows, s_ptr, w0, offs_k, K, rows_n, stride_sn, EVEN_K, BLOCK_SCALES, SCALE_BN, SCALE_BK)
    if K_TILES == 2:
        acc += _products(x_rows, s_ptr, w1, offs_k + BLOCK_K, K, rows_n, stride_sn, EVEN_K, BLOCK_SCALES,
                         SCALE_BN, SCALE_BK)
    for k0 in range(BLOCK_K * K_TILES, K, BLOCK_K * K_TILES):
        ks = k0 + offs_k
        w0 = _w_tile(w_rows, ks, K, EVEN_K)
        if K_TILES == 2:
            w1 = _w_tile(w_rows, ks + BLOCK_K, K, EVEN_K)
        acc += _products(x_rows, s_ptr, w0, ks, K, rows_n, stride_sn, EVEN_K, BLOCK_SCALES, SCALE_BN, SCALE_BK)
        if K_TILES == 2:
            acc += _products(x_rows, s_ptr, w1, ks + BLOCK_K, K, rows_n, stride_sn, EVEN_K, BLOCK_SCALES,
                             SCALE_BN, SCALE_BK)
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    n_mask = offs_n < N
    if not BLOCK_SCALES:
        y = y * tl.load(s_ptr + rows_n)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_n).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & n_mask[None, :])


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             tiles: Fp8Tiles, block: tuple[int, int] | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous) @ (weight [N, K] fp8 * scale)^T (+ bias) -> [M, N] in x's dtype. scale: [N]
    float32 (per row) or, with `block` (bn, bk), [cdiv(N, bn), cdiv(K, bk)] float32. One kernel, grid from
    shapes only: CUDA-graph safe. pdl: launch with programmatic dependent launch (kernels/pdl.py)."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous() and scale.is_contiguous()
    assert scale.dtype == torch.float32 and tiles.k_tiles in (1, 2)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    bn, bk = block if block is not None else (1, 1)
    _fp8_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block is not None else 1, out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, K_TILES=tiles.k_tiles,
        EVEN_K=k % (tiles.block_k * tiles.k_tiles) == 0, HAS_BIAS=bias is not None,
        BLOCK_SCALES=block is not None, SCALE_BN=bn, SCALE_BK=bk, PDL=pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **launch_options(pdl),
    )
    return out
