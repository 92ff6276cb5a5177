"""W8A8 at a few rows: FP8 weights times per-token FP8 activations on the FP8 tensor cores, no widening at all.

Why a candidate beside the W8A16 GEMV (kernels/fp8_gemv.py): that GEMV converts every weight byte to fp32 on the
CUDA cores, several instructions a byte, while one byte arrives every ~0.24 ps; if the conversions and not the
memory set its pace, only a kernel that never converts reaches the FP8 floor. Here both operands stay E4M3 into
tl.dot, as vLLM's FP8 path does at every batch size. The cost is the activations' rounding to E4M3 (x quantized
per token by kernels/fp8_tokens.quantize_tokens), as _scaled_mm already pays above the GEMV's rows.

Algorithm: kernels/skinny.py's, on fp8: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N outputs for all M rows
(M padded to M_PAD >= 16) and walks K: tl.dot of the [BLOCK_N, BLOCK_K] weight tile with the [BLOCK_K, M_PAD]
quantized activations (both K-major, as FP8 wgmma wants), fp32 accumulator, times the weight row's scale and
the token's scale at the end. Per-row weight scales only. The first weight tile is requested before the PDL
wait (weights are never written by a step). One kernel per call, grid from shapes only: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.fp8_gemv import program_rows
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)


@dataclass(frozen=True)
class W8a8Tiles:
    """block_n outputs (>= 16) by block_k inputs (>= 32) per K step, both powers of two."""

    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 3


@_jit
def _w8a8_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                 M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DOT_F32: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    offs_n, offs_m, offs_k, rows_n, w_rows = program_rows(w_ptr, N, stride_wn, BLOCK_N, M_PAD, BLOCK_K)
    x_cols = xq_ptr + tl.minimum(offs_m, M - 1)[None, :] * stride_xm  # [1, M_PAD]: x read transposed
    w = tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0)  # before the wait
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, M_PAD], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        if k0 > 0:
            w = tl.load(w_rows + ks[None, :], mask=(ks < K)[None, :], other=0.0)
        x_t = tl.load(x_cols + ks[:, None], mask=(ks < K)[:, None], other=0.0)  # [BLOCK_K, M_PAD]
        if DOT_F32:  # the interpreter: E4M3 values are exact in fp32
            acc = tl.dot(w.to(tl.float32), x_t.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, x_t, acc)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = acc * tl.load(ws_ptr + rows_n)[:, None] * tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows_n).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=n_mask[:, None] & m_mask[None, :])


def fp8_w8a8(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
             bias: torch.Tensor | None, tiles: W8a8Tiles, out_dtype: torch.dtype, pdl: bool = False) -> torch.Tensor:
    """(xq [M, K] fp8 * x_scale [M, 1]) @ (weight [N, K] fp8 * scale [N])^T (+ bias) -> [M, N] in out_dtype,
    accumulated in fp32. xq, x_scale: what quantize_tokens returns. pdl: programmatic dependent launch."""
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous() and scale.shape == (n,)
    assert x_scale.numel() == m and x_scale.is_contiguous() and x_scale.dtype == scale.dtype == torch.float32
    out = torch.empty(m, n, device=xq.device, dtype=out_dtype)
    if m == 0 or n == 0:
        return out
    _w8a8_kernel[(triton.cdiv(n, tiles.block_n),)](
        xq, x_scale, weight, scale, bias if bias is not None else scale, out, m, n, k, xq.stride(0),
        weight.stride(0), out.stride(0), M_PAD=max(16, triton.next_power_of_2(m)), BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
        DOT_F32=type(_w8a8_kernel).__name__ == "InterpretedFunction", PDL=pdl, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **launch_options(pdl),
    )
    return out
