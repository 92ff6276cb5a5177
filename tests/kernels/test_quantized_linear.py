"""The decoder's kernel sets hand a QuantizedLinear its input through its own `linear`, and fold nothing into it
unless its format says it does (QuantizedLinear.folds; FP8's fold: tests/kernels/test_fp8_stream.py)."""

import torch

from ostinato.kernels.fused import TORCH_KERNELS, TRITON_KERNELS_PDL
from ostinato.kernels.gemv import folds_glu, small_batch_linear, small_batch_norm_linear
from ostinato.kernels.quantized_linear import QuantizedLinear


class RowScaledInt8(QuantizedLinear):
    """A minimal format for the interface's tests: int8 weights with one float scale per output row."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-8) / 127
        self.register_buffer("qweight", torch.round(weight / scale).to(torch.int8))
        self.register_buffer("scale", scale.float())
        self.bias = None
        self.calls = []

    def linear(self, x, pdl=False):
        self.calls.append(pdl)
        return (x.float() @ self.dequantize().T).to(x.dtype)

    def dequantize(self):
        return self.qweight.float() * self.scale

    def weight_bytes(self):
        return self.qweight.numel() + 4 * self.scale.numel()


def test_triton_path_calls_the_layers_own_linear_with_pdl():
    layer = RowScaledInt8(torch.randn(64, 32))
    x = torch.randn(2, 32).to(torch.bfloat16)
    y = small_batch_linear(x, layer, pdl=True)
    assert layer.calls == [True]
    torch.testing.assert_close(y.float(), (x.float() @ layer.dequantize().T).to(torch.bfloat16).float())
    TRITON_KERNELS_PDL.linear(x, layer)
    assert layer.calls == [True, True]


def test_nothing_folds_into_a_quantized_projection_by_default():
    layer = RowScaledInt8(torch.randn(64, 32))
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert not folds_glu(x, layer)
    assert small_batch_norm_linear(x, None, torch.ones(32, dtype=torch.bfloat16), 1e-6, layer) is None


def test_torch_path_runs_the_module():
    layer = RowScaledInt8(torch.randn(8, 16))
    x = torch.randn(3, 16)
    torch.testing.assert_close(TORCH_KERNELS.linear(x, layer), x @ layer.dequantize().T)
    assert layer.weight_bytes() == 8 * 16 + 4 * 8
