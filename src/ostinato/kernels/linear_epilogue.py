"""Epilogues the small-batch linear kernels share (kernels/gemv.py, kernels/skinny.py), the SwiGLU's arithmetic
every kernel that computes it uses (kernels/fused.py, kernels/gguf_int8_input.py, kernels/fp8_tokens.py), and the
residual sum of the kernels that normalise a row (kernels/fused.py's norm, kernels/gguf_int8_input.py,
kernels/fp8_tokens.py; the norm itself: kernels/rounding.py)."""

from __future__ import annotations

from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

if triton is not None:  # the torch path needs none of these
    from ostinato.kernels.rounding import round_like


@_jit
def silu_mul(gate, up, like_ptr, EMULATE_BF16: tl.constexpr):
    """silu(gate) * up (fp32 values of the model dtype) as the unfused torch ops give it in like_ptr's dtype: silu
    rounded to that dtype before the multiply, the product rounded."""
    act = round_like(gate / (1.0 + tl.exp(-gate)), like_ptr, EMULATE_BF16)
    return round_like(act * up, like_ptr, EMULATE_BF16)


@_jit
def residual_sum(x_ptr, r_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """x (+ the residual, the sum rounded to the model dtype, as fused_add_rms_norm stores it) at offs, float32."""
    h = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        h = round_like(h + tl.load(r_ptr + offs, mask=mask, other=0.0).to(tl.float32), x_ptr, EMULATE_BF16)
    return h


@_jit
def store_glu(out_ptr, y, offs_m, cols, mask, stride_om, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              EMULATE_BF16: tl.constexpr):
    """y [M_PAD, BLOCK_N] fp32, its columns (gate, up) pairs of a (gate | up) projection -> silu(gate) * up
    [M_PAD, BLOCK_N // 2] stored at out[offs_m, cols], in the unfused order (kernels/fused.py's silu_and_mul
    after the projection's store): gate and up rounded to the model dtype, silu rounded before the multiply,
    the product rounded. So the fold changes no value but by the projection's own reduction order."""
    gate, up = tl.split(tl.reshape(y, [M_PAD, BLOCK_N // 2, 2]))  # [M_PAD, BLOCK_N // 2] each
    gate = round_like(gate, out_ptr, EMULATE_BF16)
    up = round_like(up, out_ptr, EMULATE_BF16)
    out = silu_mul(gate, up, out_ptr, EMULATE_BF16)
    tl.store(out_ptr + offs_m[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def glu_rows(pid, N, BLOCK_N: tl.constexpr, GLU: tl.constexpr):
    """A program's BLOCK_N weight rows and the output column of each, [BLOCK_N] both. GLU: N outputs
    silu(gate) * up from a [2N, K] (gate | up) weight, the rows in (gate, up) pairs: gate j is weight row j, up
    j is row N + j; else row i makes output i."""
    if GLU:
        offs_r = tl.arange(0, BLOCK_N)
        offs_n = pid * (BLOCK_N // 2) + offs_r // 2
        w_index = offs_n + (offs_r % 2) * N
    else:
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        w_index = offs_n
    return offs_n, w_index
