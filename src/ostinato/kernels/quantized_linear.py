"""The one interface every quantized projection implements, whatever its format (FP8, GGUF blocks, ...).

A quantized projection keeps its weight on the device in the checkpoint's own encoding and computes
y = x @ W^T (+ bias) from it, so that a decode step reads the quantized bytes, not a bf16 copy. The decoder
does not know the formats: its kernel sets (kernels/fused.py) hand any QuantizedLinear its input through
`linear`, and never fold a norm or the SwiGLU activation into it. Each format lives in its own module and
subclasses this one; its reference is `dequantize`, against which the tests check its kernels in float64.
"""

from __future__ import annotations

import torch
from torch import nn


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
