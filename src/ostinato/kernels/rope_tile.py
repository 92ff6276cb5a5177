"""Triton building blocks for per-head q/k RMSNorm + RoPE on tiles of head rows, shared by the decoder's
q/k-norm + RoPE kernel (kernels/fused.py) and the decode attention kernel that applies them itself
(kernels/decode_attention.py), so both round exactly as the torch path does (kernels/fused.py's module doc)."""

from __future__ import annotations

import triton
import triton.language as tl

from ostinato.kernels.rounding import rms_normed, round_like


@triton.jit
def rope_partner(d, HEAD_DIM: tl.constexpr):
    """rotate_half pairs element d with d +- D/2 (the signed-sin table carries its minus sign)."""
    return tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)


@triton.jit
def rope_table(cos_sin_ptr, position, stride_cs, d, HEAD_DIM: tl.constexpr):
    """cos and signed sin of one position, [1, HEAD_DIM_PAD] fp32 each (0 past HEAD_DIM)."""
    table = cos_sin_ptr + position.to(tl.int64) * stride_cs
    d_mask = d < HEAD_DIM
    cos = tl.load(table + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    signed_sin = tl.load(table + HEAD_DIM + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    return cos, signed_sin


@triton.jit
def norm_rope(x, x_partner, w, w_partner, cos, signed_sin, eps, dtype_ptr, HEAD_DIM: tl.constexpr,
              QK_NORM: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Rows x [R, HEAD_DIM_PAD] fp32 and their rotate_half partners -> (QK_NORM: per-row RMSNorm times the
    weight w, then) RoPE, in fp32 rounded to dtype_ptr's element type at each step the torch path stores."""
    if QK_NORM:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=1) / HEAD_DIM + eps)[:, None]  # [R, 1]
        # As the torch path: normalise, round, multiply by the head's weight, round (x and partner alike).
        x = rms_normed(x, rstd, w, dtype_ptr, EMULATE_BF16)
        x_partner = rms_normed(x_partner, rstd, w_partner, dtype_ptr, EMULATE_BF16)
    # apply_rope's order: x * cos rounded (a mul kernel), then one addcmul with the swapped halves.
    out = round_like(x * cos, dtype_ptr, EMULATE_BF16) + x_partner * signed_sin
    return round_like(out, dtype_ptr, EMULATE_BF16)


@triton.jit
def norm_weights(w_ptr, d, HEAD_DIM: tl.constexpr, QK_NORM: tl.constexpr):
    """The per-head RMSNorm weight and its rotate_half partner, [1, HEAD_DIM_PAD] fp32 each (zeros, unread,
    without QK_NORM). Separate from the rows' loads so that a kernel can request them early: they are
    weights, which no kernel of the step writes (the decode kernel reads them before its PDL wait)."""
    d_mask = d < HEAD_DIM
    if QK_NORM:
        partner = rope_partner(d, HEAD_DIM)
        w = tl.load(w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        w_partner = tl.load(w_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    else:
        w = tl.zeros_like(d)[None, :].to(tl.float32)
        w_partner = w
    return w, w_partner


@triton.jit
def load_norm_rope(row_ptrs, row_mask, d, w, w_partner, cos, signed_sin, eps, dtype_ptr, HEAD_DIM: tl.constexpr,
                   QK_NORM: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Rows at row_ptrs [R, 1] (head_dim contiguous; row_mask [R, 1]) loaded with their partners, then
    norm_rope with one weight vector (w, w_partner from norm_weights). [R, HEAD_DIM_PAD] fp32."""
    partner = rope_partner(d, HEAD_DIM)
    d_mask = d < HEAD_DIM
    mask = row_mask & d_mask[None, :]
    x = tl.load(row_ptrs + d[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(row_ptrs + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return norm_rope(x, x_partner, w, w_partner, cos, signed_sin, eps, dtype_ptr, HEAD_DIM, QK_NORM, EMULATE_BF16)
