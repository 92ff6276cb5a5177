"""Plain-torch references of the fused decoder kernels (kernels/fused.py): the CPU path and the test oracle.

Each computes what its Triton kernel does, in the order HF's modules do it; the rounding notes are in
kernels/fused.py's docstring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """HF's `x * cos + rotate_half(x) * sin` in three kernels (cat, mul, addcmul).

    x: [T, heads, D] (may be a strided view, e.g. the q|k part of the fused qkv output);
    cos, signed_sin: [T, 1, D]. Returns a new contiguous tensor.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # cat(x2, x1)
    return torch.addcmul(x * cos, swapped, signed_sin)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> rmsnorm(x) * weight [T, N], normalised in fp32 (torch's fused F.rms_norm)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(residual + x) * weight, residual + x), the sum rounded to the model dtype first."""
    residual = residual + x  # [T, N]
    return rms_norm_ref(residual, weight, eps), residual


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def qk_norm_rope_ref(heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                     eps: float) -> torch.Tensor:
    """Rotated (and, with weights, per-head RMS-normalised) q and k from the fused qkv projection.

    heads: [T, H + 2Hkv, D] (q | k | v heads); q_weight, k_weight: [D] each (Qwen3) or both None;
    cos_sin_cache: [max_positions, 2D] = [cos | signed sin] (RotaryEmbedding); positions: [T] int64.
    Returns a new contiguous [T, H + Hkv, D] tensor: q = out[:, :H], k = out[:, H:].
    """
    h, kv = num_heads, num_kv_heads
    if q_weight is not None:
        # Qwen3 RMS-normalises each q and k head before RoPE. One weightless norm over all heads of the
        # contiguous projection, then one multiply by the per-head weights: HF's order (normalise, round
        # to the model dtype, scale), in 3 kernels where two norms on strided views cost copies more.
        normed = F.rms_norm(heads, (heads.shape[-1],), eps=eps)[:, :h + kv]
        weight = torch.cat((q_weight.expand(h, -1), k_weight.expand(kv, -1)))  # [H + Hkv, D]
        qk = normed * weight
    else:
        qk = heads[:, :h + kv]
    cos, sin = cos_sin_cache.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D] each
    return apply_rope(qk, cos, sin)  # one RoPE application for q and k together


def linear_ref(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    return layer(x)  # the module's own forward: a tensor-parallel layer's collective included
