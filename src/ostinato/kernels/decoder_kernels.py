"""The set of implementations a decoder layer runs its non-GEMM steps with (kernels/fused.py builds the sets)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Normed:
    """An RMSNorm's output computed by the kernel of the projection before it (DecoderKernels.linear_then_norm):
    x, the input of the projection after the norm, and residual, the stream with the first projection's output
    added. The norm_then_* methods take it in place of the projection's output and launch no norm."""

    x: torch.Tensor
    residual: torch.Tensor


@dataclass(frozen=True)
class NormAfter:
    """The RMSNorm after a projection (its weight and eps) and the projection it feeds, or None where nothing
    projects its output (the final norm)."""

    weight: torch.Tensor
    eps: float
    feeds: torch.nn.Module | None


@dataclass(frozen=True)
class DecoderKernels:
    """One implementation of each non-GEMM decoder step; signatures as kernels/fused.py's functions."""

    name: str
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    fused_add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float],
                                 tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    qk_norm_rope: Callable[..., torch.Tensor]
    linear: Callable[[torch.Tensor, torch.nn.Linear], torch.Tensor]  # (x, layer) -> layer(x)
    # qk_norm_rope that also writes k and v to the paged cache (the backend's write_kv folded in), or None
    # where the set has no such kernel; Attention uses it when its backend accepts it (attention/base.py).
    qk_norm_rope_write_kv: Callable[..., torch.Tensor] | None = None
    # The norm folded into the projection after it (kernels/gemv.py), where one kernel can take both at these
    # shapes; it returns None where it cannot, and norm_then_linear then launches the two apart. None: never.
    norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None
    # (x, layer) -> whether linear and norm_linear take glu=True for the (gate | up) projection at these shapes:
    # silu(gate) * up out of the projection's own kernel, no activation kernel after it. None: never.
    folds_glu: Callable[[torch.Tensor, torch.nn.Linear], bool] | None = None
    # (gate_up, layer) -> layer(silu(gate) * up) with the activation computed by the kernel that prepares the
    # projection's input, or None where it cannot (norm_then_mlp then launches it apart). None: never.
    glu_linear: Callable[[torch.Tensor, torch.nn.Linear], torch.Tensor | None] | None = None
    # (hidden [M, K], lm_head weight [V, K]) -> fp32 logits [M, V], where the set computes them itself (the
    # batch-invariant sets, kernels/invariant_linear.py). None: model/decoder.py's compute_logits decides.
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # (x, layer) -> room for layer's input x quantized to int8 per 32 values (kernels/gguf_int8_dot.QuantizedX)
    # where layer's kernel reads it so (GGUF's integer dot products), for the decode attention to write o_proj's
    # input there, or None; and (that room filled in, x, layer) -> layer(x). None: never. Of x only its shape and
    # dtype count.
    int8_input: Callable[[torch.Tensor, torch.nn.Linear], object | None] | None = None
    int8_input_linear: Callable[[object, torch.Tensor, torch.nn.Linear], torch.Tensor] | None = None
    # (x, layer, residual, norm weight, eps, the projection after the norm or None) -> (rmsnorm(layer(x) + residual)
    # * weight, layer(x) + residual) out of layer's own launch, where its kernel can at these shapes and the
    # projection after takes no norm into its own kernel, else None. None: never.
    linear_norm: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def linear_then_norm(self, x: torch.Tensor, layer: torch.nn.Linear, residual: torch.Tensor | None,
                         after: NormAfter | None) -> torch.Tensor | Normed:
        """layer(x), or, where layer's kernel also adds the residual and computes the norm after it (linear_norm),
        Normed: what norm_then_* would have launched the norm for."""
        if self.linear_norm is not None and after is not None and residual is not None:
            done = self.linear_norm(x, layer, residual, after.weight, after.eps, after.feeds)
            if done is not None:
                return Normed(*done)
        return self.linear(x, layer)

    def final_norm(self, x: torch.Tensor | Normed, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
        """rmsnorm(x + residual) * weight, the last layer's output normalised (Normed: already)."""
        if isinstance(x, Normed):
            return x.x
        return self.fused_add_rms_norm(x, residual, weight, eps)[0]

    def norm_then_linear(self, x: torch.Tensor | Normed, residual: torch.Tensor | None, weight: torch.Tensor,
                         eps: float, layer: torch.nn.Linear, glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer(rmsnorm(x + residual) * weight), x + residual); residual None: the norm of x alone, and x
        is the residual returned. [T, K] -> ([T, N], [T, K]). glu: silu(gate) * up [T, N / 2] of a (gate |
        up) layer from the projection's kernel, only where folds_glu said so (norm_then_glu). x Normed: the
        norm is done, only the projection runs."""
        fold = {"glu": True} if glu else {}  # the torch set's functions take no such flag
        if isinstance(x, Normed):
            return self.linear(x.x, layer, **fold), x.residual
        if self.norm_linear is not None:
            folded = self.norm_linear(x, residual, weight, eps, layer, **fold)
            if folded is not None:
                return folded
        if residual is None:
            normed, residual = self.rms_norm(x, weight, eps), x
        else:
            normed, residual = self.fused_add_rms_norm(x, residual, weight, eps)
        return self.linear(normed, layer, **fold), residual

    def norm_then_glu(self, x: torch.Tensor | Normed, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, layer: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's first half: (silu(gate) * up of layer(rmsnorm(x + residual) * weight), x + residual),
        layer the (gate | up) projection. [T, K] -> ([T, I], [T, K]). The activation comes out of the
        projection's kernel where folds_glu says so, else from its own kernel after it."""
        if self.folds_glu is not None and self.folds_glu(_tensor(x), layer):
            return self.norm_then_linear(x, residual, weight, eps, layer, glu=True)
        gate_up, residual = self.norm_then_linear(x, residual, weight, eps, layer)
        return self.silu_and_mul(gate_up), residual

    def norm_then_mlp(self, x: torch.Tensor | Normed, residual: torch.Tensor | None, weight: torch.Tensor,
                      eps: float, gate_up: torch.nn.Linear, down: torch.nn.Linear,
                      after: NormAfter | None = None) -> tuple[torch.Tensor | Normed, torch.Tensor]:
        """The MLP: (down(silu(gate) * up) of gate_up(rmsnorm(x + residual) * weight), x + residual). [T, K] ->
        ([T, K], [T, K]). The activation comes out of gate_up's kernel where folds_glu says so, else goes into
        the kernel that prepares down's input where glu_linear takes it, else is its own kernel between them.
        after: the norm after the MLP, which down's kernel computes where it can (linear_then_norm: the output
        is then Normed)."""
        if self.glu_linear is None or (self.folds_glu is not None and self.folds_glu(_tensor(x), gate_up)):
            act, residual = self.norm_then_glu(x, residual, weight, eps, gate_up)
            out = self.linear_then_norm(act, down, residual, after)
            return out, out.residual if isinstance(out, Normed) else residual
        h, residual = self.norm_then_linear(x, residual, weight, eps, gate_up)
        out = self.glu_linear(h, down)
        return (out if out is not None else self.linear(self.silu_and_mul(h), down)), residual


def _tensor(x: torch.Tensor | Normed) -> torch.Tensor:
    """The tensor a projection after x reads: its shape and dtype decide the kernels."""
    return x.x if isinstance(x, Normed) else x
