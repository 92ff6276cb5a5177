"""The set of implementations a decoder layer runs its non-GEMM steps with (kernels/fused.py builds the sets)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


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

    def norm_then_linear(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         layer: torch.nn.Linear, glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(layer(rmsnorm(x + residual) * weight), x + residual); residual None: the norm of x alone, and x
        is the residual returned. [T, K] -> ([T, N], [T, K]). glu: silu(gate) * up [T, N / 2] of a (gate |
        up) layer from the projection's kernel, only where folds_glu said so (norm_then_glu)."""
        fold = {"glu": True} if glu else {}  # the torch set's functions take no such flag
        if self.norm_linear is not None:
            folded = self.norm_linear(x, residual, weight, eps, layer, **fold)
            if folded is not None:
                return folded
        if residual is None:
            normed, residual = self.rms_norm(x, weight, eps), x
        else:
            normed, residual = self.fused_add_rms_norm(x, residual, weight, eps)
        return self.linear(normed, layer, **fold), residual

    def norm_then_glu(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      layer: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP's first half: (silu(gate) * up of layer(rmsnorm(x + residual) * weight), x + residual),
        layer the (gate | up) projection. [T, K] -> ([T, I], [T, K]). The activation comes out of the
        projection's kernel where folds_glu says so, else from its own kernel after it."""
        if self.folds_glu is not None and self.folds_glu(x, layer):
            return self.norm_then_linear(x, residual, weight, eps, layer, glu=True)
        gate_up, residual = self.norm_then_linear(x, residual, weight, eps, layer)
        return self.silu_and_mul(gate_up), residual

    def norm_then_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      gate_up: torch.nn.Linear, down: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLP: (down(silu(gate) * up) of gate_up(rmsnorm(x + residual) * weight), x + residual). [T, K] ->
        ([T, K], [T, K]). The activation comes out of gate_up's kernel where folds_glu says so, else goes into
        the kernel that prepares down's input where glu_linear takes it, else is its own kernel between them."""
        if self.glu_linear is None or (self.folds_glu is not None and self.folds_glu(x, gate_up)):
            act, residual = self.norm_then_glu(x, residual, weight, eps, gate_up)
            return self.linear(act, down), residual
        h, residual = self.norm_then_linear(x, residual, weight, eps, gate_up)
        out = self.glu_linear(h, down)
        return (out if out is not None else self.linear(self.silu_and_mul(h), down)), residual
