"""The one interface every quantized projection implements, whatever its format (FP8, GGUF blocks, ...).

A quantized projection keeps its weight on the device in the checkpoint's own encoding and computes
y = x @ W^T (+ bias) from it, so that a decode step reads the quantized bytes, not a bf16 copy. The decoder
does not know the formats: its kernel sets (kernels/fused.py) hand any QuantizedLinear its input through
`linear`; a format whose few-rows kernel can also take the RMSNorm before the projection or the SwiGLU after
it says so through `folds` and computes them in `fused_linear` (FP8 both, at different rows; GGUF the norm
only), and one whose kernel can take the SwiGLU before it (the down projection's input) through
`takes_glu_input` and `glu_input_linear` (GGUF, FP8), and one whose kernel reads its input quantized to int8
per 32 values, which the decode attention can write for o_proj, through `int8_input` and `int8_input_linear`
(GGUF); the others keep the default, no fold, and the decoder launches the norm and the activation apart. Each
format lives in its own module and subclasses this one; its reference is `dequantize`, against which the tests
check its kernels in float64.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from ostinato.kernels.gguf_int8_dot import QuantizedX


class QuantizedLinear(nn.Module):
    """A [out_features, in_features] projection held quantized. Subclasses set `bias` (a tensor in the
    activation dtype, or None) and implement `linear`, `dequantize` and `weight_bytes`."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def linear(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """x [M, K] -> [M, N] in x's dtype, for any M (a GEMV-like kernel at a few rows, a tensor-core one
        above). Graph-safe: no host sync, output allocated by shape. pdl: launch with programmatic dependent
        launch where the kernel supports it (kernels/pdl.py)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """The weight as the format defines it, [N, K] in float32: the reference for the kernels' tests."""
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes a forward reads for the weight (data and scales): what the bandwidth floor is computed from."""
        raise NotImplementedError

    def folds(self, x: torch.Tensor, norm: bool = False) -> bool:
        """Whether fused_linear takes these rows x [M, K] with a step folded into the projection's own kernel:
        without `norm`, silu(gate) * up after a (gate | up) projection (glu=True); with `norm`, the norm before
        it (both at once only where both answers are yes). Shapes and dtypes only (fixed before graph capture).
        Default: never."""
        return False

    def fused_linear(self, x: torch.Tensor, pdl: bool = False, glu: bool = False,
                     norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Where folds(x): (y, next residual). glu: y is silu(gate) * up [M, N / 2] of a (gate | up) weight.
        norm (residual or None, norm_weight [K], eps): x is first rmsnorm(x + residual) * norm_weight, and the
        next residual x + residual (x without one) comes back second (None without norm): kernels/gemv.py's
        gemv_norm_linear contract."""
        raise NotImplementedError

    def takes_glu_input(self, gate_up: torch.Tensor) -> bool:
        """Whether glu_input_linear takes these rows gate_up [M, 2 in_features] (a (gate | up) projection's output):
        silu(gate) * up computed by the kernel that prepares this projection's input. Shapes and dtypes only (fixed
        before graph capture). Default: never."""
        return False

    def glu_input_linear(self, gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """Where takes_glu_input(gate_up): (silu(gate) * up) @ W^T (+ bias), [M, out_features]."""
        raise NotImplementedError

    def int8_input(self, x: torch.Tensor) -> QuantizedX | None:
        """Where this projection's kernel reads these rows x [M, in_features] quantized to int8 per 32 values
        (GGUF's integer-dot rows), room for them (kernels/gguf_int8_dot.QuantizedX), which the kernel that makes x
        may fill instead of a quantizing launch of the projection's own; of x only its shape, dtype and device
        are used (fixed before graph capture). Default: None, x is read as is."""
        return None

    def int8_input_linear(self, qx: QuantizedX, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        """linear(x) from int8_input(x), filled in by the kernel before; of x only its shape and dtype."""
        raise NotImplementedError

    def linear_then_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(y + residual) * norm_weight, y + residual), y = linear(x), both [M, out_features], out of the
        projection's own launch, where its kernel computes the norm after it at these rows; else None (launch
        nothing: the caller runs linear and the norm apart). Default: None."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
