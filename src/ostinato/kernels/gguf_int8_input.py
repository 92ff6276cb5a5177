"""What comes before a GGUF projection folded into the quantization of its input (kernels/gguf_int8_dot.py): the
RMSNorm before qkv and gate_up, the SwiGLU before down. One kernel gives the integer-dot kernels' activations (and,
after a norm, the next residual).

Why: where the projection takes integer dot products (at the rows gguf_int8_dot.INT8_DOT_ROWS gives), the decoder
would launch the norm kernel (or the SiLU-and-mul kernel), then the quantizing kernel, each a few microseconds of
latency on the path of a one-row step and neither reading much. The bf16 GEMV folds the norm into its own kernel
and the SwiGLU into gate_up's (kernels/gemv.py); the integer-dot kernels cannot take either, since x is quantized
per 32 values before any program multiplies, so the fold goes into the quantization instead.

Each program takes BLOCKS 32-blocks of a row, as the quantizing kernel does. The norm's programs first pass over
the whole row (x + residual, from L2: K <= gemv.NORM_FOLD_MAX_K) for its 1/rms. The arithmetic is the norm
kernel's and the SiLU-and-mul kernel's (kernels/fused.py: each intermediate rounded to the model dtype where
theirs stores it), then the quantizing kernel's on those rounded values; only the norm's sum of squares is reduced
in another order.
"""

from __future__ import annotations

import torch

from ostinato.kernels.gguf_int8_dot import QUANTIZE_BLOCKS, QuantizedX, empty_quantized, store_quantized
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

if triton is not None:
    from ostinato.kernels.linear_epilogue import residual_sum, silu_mul
    from ostinato.kernels.rounding import rms_normed


@_jit
def _norm_quantize_x_kernel(x_ptr, res_ptr, w_ptr, res_out_ptr, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, K,
                            stride_xm, stride_rm, eps, ROW: tl.constexpr, BLOCKS: tl.constexpr,
                            HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(1): h = x + residual (the next residual, stored by each program for its blocks), y =
    rmsnorm(h) * w, and y's BLOCKS 32-blocks quantized as _quantize_x_kernel quantizes x. ROW: a power of two
    >= K."""
    pdl_begin(PDL)
    r = tl.program_id(1)
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    b_mask = b < K // 32
    word = b[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BLOCKS, 8]
    col = word[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [BLOCKS, 8, 4]
    col_mask = b_mask[:, None, None]
    w = tl.load(w_ptr + col, mask=col_mask, other=0.0).to(tl.float32)  # a weight: may precede the wait
    offs = tl.arange(0, ROW)
    x_row, r_row = x_ptr + r * stride_xm, res_ptr + r * stride_rm
    pdl_wait(PDL)
    h_row = residual_sum(x_row, r_row, offs, offs < K, HAS_RESIDUAL, EMULATE_BF16)
    rstd = tl.math.rsqrt(tl.sum(h_row * h_row, axis=0) / K + eps)
    h = residual_sum(x_row, r_row, col, col_mask, HAS_RESIDUAL, EMULATE_BF16)
    if HAS_RESIDUAL:
        tl.store(res_out_ptr + r * K + col, h.to(res_out_ptr.dtype.element_ty), mask=col_mask)
    y = rms_normed(h, rstd, w, x_ptr, EMULATE_BF16)
    store_quantized(y, r, b, b_mask, word, K, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, BLOCKS)


@_jit
def _glu_quantize_x_kernel(gate_up_ptr, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, K, stride_gm,
                           BLOCKS: tl.constexpr, EMULATE_BF16: tl.constexpr, PDL: tl.constexpr):
    """Row program_id(1) of gate_up [M, 2K] (gate | up): y = silu(gate) * up, and y's BLOCKS 32-blocks quantized
    as _quantize_x_kernel quantizes x."""
    pdl_begin(PDL)
    r = tl.program_id(1)
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    b_mask = b < K // 32
    word = b[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BLOCKS, 8]
    gate_at = gate_up_ptr + r * stride_gm + word[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # [BLOCKS, 8, 4]
    pdl_wait(PDL)
    gate = tl.load(gate_at, mask=b_mask[:, None, None], other=0.0).to(tl.float32)
    up = tl.load(gate_at + K, mask=b_mask[:, None, None], other=0.0).to(tl.float32)
    y = silu_mul(gate, up, gate_up_ptr, EMULATE_BF16)
    store_quantized(y, r, b, b_mask, word, K, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, BLOCKS)


def norm_quantize_x(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    pdl: bool = False) -> tuple[QuantizedX, torch.Tensor]:
    """(quantize_x(rmsnorm(x + residual) * weight), x + residual) in one kernel, x and residual [M, K] (rows may
    be strided, columns contiguous; residual None: the norm of x, and x itself comes back second)."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    m, k = x.shape
    assert k % 32 == 0 and x.stride(-1) == 1 and weight.shape == (k,)
    assert residual is None or (residual.shape == x.shape and residual.stride(-1) == 1)
    qx = empty_quantized(m, k, x.device)
    res_out = x if residual is None else torch.empty(m, k, device=x.device, dtype=x.dtype)
    _norm_quantize_x_kernel[(triton.cdiv(k // 32, QUANTIZE_BLOCKS), m)](
        x, x if residual is None else residual, weight, res_out, *qx, k, x.stride(0),
        0 if residual is None else residual.stride(0), eps, ROW=triton.next_power_of_2(k), BLOCKS=QUANTIZE_BLOCKS,
        HAS_RESIDUAL=residual is not None, EMULATE_BF16=KERNELS_INTERPRETED and x.dtype == torch.bfloat16,
        PDL=pdl, num_warps=4, **launch_options(pdl))
    return qx, res_out


def glu_quantize_x(gate_up: torch.Tensor, pdl: bool = False) -> QuantizedX:
    """quantize_x(silu(gate) * up) in one kernel, gate_up [M, 2K] (gate | up, the fused projection's output; rows
    may be strided, columns contiguous)."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    m, two_k = gate_up.shape
    k = two_k // 2
    assert two_k % 64 == 0 and gate_up.stride(-1) == 1
    qx = empty_quantized(m, k, gate_up.device)
    _glu_quantize_x_kernel[(triton.cdiv(k // 32, QUANTIZE_BLOCKS), m)](
        gate_up, *qx, k, gate_up.stride(0), BLOCKS=QUANTIZE_BLOCKS,
        EMULATE_BF16=KERNELS_INTERPRETED and gate_up.dtype == torch.bfloat16, PDL=pdl, num_warps=4,
        **launch_options(pdl))
    return qx
