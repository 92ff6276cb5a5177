"""FP8 projections at more rows than the GEMV (kernels/fp8_gemv.py) takes: the Triton W8A16 tensor-core kernel, and
the one-kernel per-token activation quantization that feeds torch._scaled_mm (the FP8 tensor cores).

Why one quantization kernel: the same in torch ops (abs, amax, float, clamp, divide, divide, clamp, cast) is
about eight launches per projection, four projections a layer; in a decode graph of 64 rows those launches
cost more than the FP8 GEMM saved over bf16, and in eager mode they doubled the step. The kernel reads each
row twice (once for its largest magnitude, once to scale and round it; the second read hits L2) and writes
the fp8 row and its float32 scale, the values quantize_per_token computes.
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


@_jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
                            FP8_LIMIT: tl.constexpr, FLOOR: tl.constexpr, PDL: tl.constexpr):
    """One program a row: its largest magnitude, then the row divided by max / FP8_LIMIT, rounded to E4M3."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    pdl_wait(PDL)
    peak = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(x))
    scale = tl.maximum(tl.max(peak, axis=0), FLOOR) / FP8_LIMIT
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs
        x = tl.load(x_ptr + row * stride_xm + ks, mask=ks < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)  # IEEE division, as torch's
        tl.store(q_ptr + row * stride_qm + ks, q.to(q_ptr.dtype.element_ty), mask=ks < K)


def quantize_tokens(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token (kernels/fp8_linear.py) in one Triton kernel: x [M, K] (K contiguous) -> (fp8 [M, K],
    float32 scales [M, 1]). Grid from shapes only: CUDA-graph safe."""
    m, k = x.shape
    assert x.stride(-1) == 1
    q = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    if m == 0:
        return q, scale
    _quantize_tokens_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0),
                                  BLOCK_K=min(2048, triton.next_power_of_2(k)), FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR,
                                  PDL=pdl, num_warps=4, **launch_options(pdl))
    return q, scale
