"""The model dtype's rounding inside Triton kernels: what storing an fp32 value in bf16/fp16 does, and the RMSNorm in
the order the torch path rounds it. Every kernel that folds a norm (or another step the torch path stores) into
itself computes it with these, so the fold changes no value (kernels/fused.py's module doc)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_like(x, ptr, EMULATE_BF16: tl.constexpr):
    """fp32 x rounded to ptr's element type and back to fp32: what storing it in the model dtype does.
    EMULATE_BF16 rounds to nearest even by hand (the interpreter's own cast truncates)."""
    if EMULATE_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def rms_normed(h, rstd, w, like_ptr, EMULATE_BF16: tl.constexpr):
    """rmsnorm(h) * w as the norm kernel stores it (kernels/fused.py, HF's order): h * rstd rounded to like_ptr's
    dtype, times the weight w, rounded again. Any broadcastable shapes."""
    return round_like(round_like(h * rstd, like_ptr, EMULATE_BF16) * w, like_ptr, EMULATE_BF16)


@triton.jit
def rms_norm_row(h, w, n, eps, like_ptr, EMULATE_BF16: tl.constexpr):
    """rms_normed of a whole row h [BLOCK] held in registers (n values, zeros past them): its 1/rms from the mean
    of its squares over n, plus eps."""
    return rms_normed(h, tl.math.rsqrt(tl.sum(h * h, axis=0) / n + eps), w, like_ptr, EMULATE_BF16)
