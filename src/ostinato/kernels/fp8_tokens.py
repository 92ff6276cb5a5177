"""Activations quantized to E4M3 per token for the W8A8 projections (kernels/fp8_linear.py: the split GEMM on FP8
activations, the W8A8 few-rows kernel, torch._scaled_mm), one kernel a projection input, from one of three
sources: x itself (`quantize_tokens`), the RMSNorm before the projection (`norm_quantize_tokens`: the norm
folded in), or the SwiGLU before it (`glu_quantize_tokens`: gate_up's output, silu(gate) * up folded in).

Why one kernel: the same in torch ops (abs, amax, float, clamp, divide, divide, clamp, cast) is about eight
launches a projection, which in a 64-row decode graph cost more than the FP8 GEMM saved over bf16. Why one program
a row, the row held in registers: at decode rows the kernel is latency, not bytes (64 rows of 4096 values are
512 KB). Read in pieces, a row costs a round trip to L2 per piece and per pass, one after another; a norm or SwiGLU
kernel of its own before it costs a launch and another round trip. Rows longer than WHOLE_ROW_MAX_K are read in
pieces, twice (plain x only; the folds are not taken there).

Values: what the unfused kernels store, bit for bit. The norm and the SwiGLU are kernels/fused.py's rms_norm and
silu_and_mul's fp32 operations in their order, rounded to the model dtype where those store; then the row's largest
magnitude over FP8_MAX is its scale, and each value divided by it (IEEE division, as torch's), clamped and rounded
to E4M3: quantize_per_token's codes and scales. So a fold changes no code and no scale.
"""

from __future__ import annotations

import torch

from ostinato.kernels.fp8_mma import FP8_DTYPE, FP8_MAX, SCALE_FLOOR
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

if triton is not None:
    from ostinato.kernels.linear_epilogue import residual_sum, silu_mul
    from ostinato.kernels.rounding import rms_norm_row

# Rows up to this long are quantized from registers (16 warps, 32 values a thread at the longest).
WHOLE_ROW_MAX_K = 16384


@_jit
def _quantize_tokens_kernel(x_ptr, r_ptr, w_ptr, res_out_ptr, q_ptr, s_ptr, stride_xm, stride_rm, stride_qm, eps,
                            K: tl.constexpr, BLOCK_K: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr, FP8_LIMIT: tl.constexpr,
                            FLOOR: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(0) of the values _row_values gives quantized: its scale at s_ptr, its codes at q_ptr.
    BLOCK_K >= K: the row in registers, read once; else (plain x) in BLOCK_K pieces, twice."""
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    q_row = q_ptr + row * stride_qm
    if BLOCK_K >= K:
        mask = offs < K
        w = tl.zeros([BLOCK_K], tl.float32)
        if NORM:
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: may precede the wait
        pdl_wait(PDL)
        y = _row_values(x_ptr, r_ptr, w, res_out_ptr, row, stride_xm, stride_rm, offs, mask, eps, K, GLU, NORM,
                        HAS_RESIDUAL, EMULATE_BF16)
        scale = tl.maximum(tl.max(tl.abs(y), axis=0), FLOOR) / FP8_LIMIT
        tl.store(s_ptr + row, scale)
        _store_codes(q_row + offs, y, scale, mask, FP8_LIMIT)
    else:
        pdl_wait(PDL)
        x_row = x_ptr + row * stride_xm
        peak = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            peak = tl.maximum(peak, tl.abs(tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(peak, axis=0), FLOOR) / FP8_LIMIT
        tl.store(s_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs
            _store_codes(q_row + ks, tl.load(x_row + ks, mask=ks < K, other=0.0).to(tl.float32), scale, ks < K,
                         FP8_LIMIT)


@_jit
def _row_values(x_ptr, r_ptr, w, res_out_ptr, row, stride_xm, stride_rm, offs, mask, eps, K: tl.constexpr,
                GLU: tl.constexpr, NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """The row to quantize, fp32: x's; with GLU silu(gate) * up of gate_up's [gate | up] (as silu_and_mul); with
    NORM rmsnorm(x + residual) * w (as rms_norm / fused_add_rms_norm, which also stores x + residual, the next
    residual, at res_out_ptr's row)."""
    x_row = x_ptr + row * stride_xm
    if GLU:
        gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + offs, mask=mask, other=0.0).to(tl.float32)
        return silu_mul(gate, up, x_ptr, EMULATE_BF16)
    h = residual_sum(x_row, r_ptr + row * stride_rm, offs, mask, HAS_RESIDUAL, EMULATE_BF16)  # residual: NORM only
    if NORM:
        if HAS_RESIDUAL:
            tl.store(res_out_ptr + row * K + offs, h.to(res_out_ptr.dtype.element_ty), mask=mask)
        h = rms_norm_row(h, w, K, eps, x_ptr, EMULATE_BF16)
    return h


@_jit
def _store_codes(q_ptrs, y, scale, mask, FP8_LIMIT: tl.constexpr):
    """y / scale, clamped to the E4M3 range and rounded to it, stored at q_ptrs."""
    q = tl.minimum(tl.maximum(tl.math.div_rn(y, scale), -FP8_LIMIT), FP8_LIMIT)  # IEEE division, as torch's
    tl.store(q_ptrs, q.to(q_ptrs.dtype.element_ty), mask=mask)


def row_tile(k: int) -> tuple[int, int]:
    """(BLOCK_K, num_warps) of the kernel for rows of k values: the whole row (a power of two >= k) where it fits the
    registers, 32 values a thread at most; else 2048-wide pieces."""
    block_k = triton.next_power_of_2(k) if k <= WHOLE_ROW_MAX_K else 2048
    return block_k, min(16, max(4, block_k // 1024))


def quantize_tokens(x: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_per_token (kernels/fp8_linear.py) in one Triton kernel: x [M, K] (K contiguous) -> (fp8 [M, K],
    float32 scales [M, 1]). Grid from shapes only: CUDA-graph safe. pdl: programmatic dependent launch."""
    assert x.stride(-1) == 1
    return _launch(x, x.shape[1], pdl)[:2]


def glu_quantize_tokens(gate_up: torch.Tensor, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_tokens(silu(gate) * up) in one kernel, gate_up [M, 2K] (gate | up, the fused projection's output;
    rows may be strided, columns contiguous), 2K <= 2 WHOLE_ROW_MAX_K."""
    k = gate_up.shape[1] // 2
    assert gate_up.shape[1] == 2 * k and k <= WHOLE_ROW_MAX_K and gate_up.stride(-1) == 1
    return _launch(gate_up, k, pdl, glu=True)[:2]


def norm_quantize_tokens(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quantize_tokens(rmsnorm(x + residual) * weight), x + residual) in one kernel: codes, scales and the next
    residual; x, residual [M, K] (columns contiguous), weight [K] in x's dtype, K <= WHOLE_ROW_MAX_K. residual None:
    the norm of x, and x itself comes back third."""
    m, k = x.shape
    assert k <= WHOLE_ROW_MAX_K and x.stride(-1) == 1 and weight.shape == (k,) and weight.dtype == x.dtype
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1 and residual.dtype == x.dtype)
    return _launch(x, k, pdl, norm=(residual, weight, eps))


def _launch(x: torch.Tensor, k: int, pdl: bool, glu: bool = False,
            norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    residual, weight, eps = norm if norm is not None else (None, None, 0.0)
    m = x.shape[0]
    q = torch.empty(m, k, device=x.device, dtype=FP8_DTYPE)
    scale = torch.empty(m, 1, device=x.device, dtype=torch.float32)
    res_out = x if residual is None else torch.empty(m, k, device=x.device, dtype=x.dtype)
    if m == 0:
        return q, scale, res_out
    block_k, num_warps = row_tile(k)
    _quantize_tokens_kernel[(m,)](
        x, residual if residual is not None else x, weight if weight is not None else x, res_out, q, scale,
        x.stride(0), residual.stride(0) if residual is not None else 0, q.stride(0), eps, K=k, BLOCK_K=block_k,
        GLU=glu, NORM=norm is not None, HAS_RESIDUAL=residual is not None,
        EMULATE_BF16=KERNELS_INTERPRETED and x.dtype == torch.bfloat16, FP8_LIMIT=FP8_MAX, FLOOR=SCALE_FLOOR,
        PDL=pdl, num_warps=num_warps, **launch_options(pdl))
    return q, scale, res_out
