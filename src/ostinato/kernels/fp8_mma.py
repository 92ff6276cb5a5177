"""FP8 projections at more rows than the GEMV (kernels/fp8_gemv.py) takes: the Triton W8A16 tensor-core kernel,
and the FP8 constants the other FP8 kernels share. The activations' per-token quantization, which feeds the W8A8
kernels and torch._scaled_mm, is kernels/fp8_tokens.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value (torch.finfo(torch.float8_e4m3fn).max)
SCALE_FLOOR = 1e-12  # an all-zero row's scale: its codes are zeros, and no division by zero


@_jit
def _fp8_mma_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, DOT_F32: tl.constexpr,
    PDL: tl.constexpr,
):
    """W8A16 on the tensor cores: a [BLOCK_M, BLOCK_N] output tile, each fp8 weight tile widened to the
    activation dtype in registers (straight to it with per-row scales, applied to the sums at the end; with
    block scales, scaled in fp32 first: BLOCK_N and BLOCK_K divide the scale block, so one scale covers the
    tile) and multiplied by tl.dot in fp32. Weight rows past N are clamped onto the last row, not masked."""
    pdl_begin(PDL)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=k_mask[None, :], other=0.0)
        if BLOCK_SCALES:
            w = (w.to(tl.float32) * tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_BN) * stride_sn + k0 // SCALE_BK))
        if DOT_F32:  # the interpreter (CPU tests) multiplies bf16 tiles wrongly: widen both, same values
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class MmaTiles:
    """The tensor-core kernel's output tile (block_m rows by block_n outputs) and K step; all >= 16."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3


MMA_TILE = MmaTiles()  # block_n and block_k divide the 128 x 128 scale blocks


def fp8_mma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            block: tuple[int, int] | None = None, tile: MmaTiles = MMA_TILE, pdl: bool = False) -> torch.Tensor:
    """fp8_gemv's contract for many rows, on the tensor cores (x bf16 or fp16; with `block`, the tile's
    block_n and block_k must divide the scale block). pdl: launch with programmatic dependent launch."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous() and scale.is_contiguous()
    assert block is None or (block[0] % tile.block_n == 0 and block[1] % tile.block_k == 0)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    sbn, sbk = block if block is not None else (1, 1)
    _fp8_mma_kernel[(triton.cdiv(m, tile.block_m), triton.cdiv(n, tile.block_n))](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block is not None else 1, out.stride(0), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k, HAS_BIAS=bias is not None, BLOCK_SCALES=block is not None, SCALE_BN=sbn,
        SCALE_BK=sbk, DOT_F32=type(_fp8_mma_kernel).__name__ == "InterpretedFunction", PDL=pdl,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **launch_options(pdl),
    )
    return out
