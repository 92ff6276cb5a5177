"""The activations' per-token FP8 quantization with the RMSNorm or the SwiGLU folded in (kernels/fp8_tokens.py):
bit for bit the unfused kernels' values quantized (kernels/fused.py's rms_norm / fused_add_rms_norm and
silu_and_mul, then quantize_tokens), and Fp8Linear taking the folds only on the split GEMM on FP8 activations,
with the same output as the unfused path there.

CPU: under TRITON_INTERPRET=1 (tests/conftest.py), bf16 and fp32, ragged widths. GPU (`-m gpu`): the 8B's widths,
and Fp8Linear's folds against its unfused path at 32 and 64 rows.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels.fp8_linear import (FP8_DTYPE, FP8_MAX, Fp8Linear, SplitTiles, SplitW8a8,  # noqa: E402
                                         quantize_rows)
from ostinato.kernels.fp8_tokens import (WHOLE_ROW_MAX_K, glu_quantize_tokens, norm_quantize_tokens,  # noqa: E402
                                         quantize_tokens)
from ostinato.kernels.fused import fused_add_rms_norm, rms_norm, silu_and_mul  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _same_codes(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert got[0].dtype == FP8_DTYPE and got[1].shape == want[1].shape
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def _rows(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen) * torch.logspace(-2, 2, m)[:, None]).to(dtype).to(DEVICE)


@pytest.mark.parametrize("m,k", [(1, 96), (3, 1000), (5, 2048 + 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_folded_in_quantizes_what_the_norm_kernel_stores(m, k, dtype, with_residual):
    x, weight = _rows(m, k, dtype, k), _rows(1, k, dtype, k + 1)[0]
    residual = _rows(m, k, dtype, k + 2) if with_residual else None
    q, scale, next_residual = norm_quantize_tokens(x, residual, weight, 1e-5)
    if with_residual:
        normed, want_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(next_residual, want_residual)
    else:
        normed = rms_norm(x, weight, 1e-5)
        assert next_residual is x
    _same_codes((q, scale), quantize_tokens(normed))


@pytest.mark.parametrize("m,k", [(1, 64), (4, 1000), (2, 4096 + 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_folded_in_quantizes_what_silu_and_mul_stores(m, k, dtype):
    gate_up = _rows(m, 2 * k, dtype, k)
    _same_codes(glu_quantize_tokens(gate_up), quantize_tokens(silu_and_mul(gate_up)))


def test_a_strided_gate_up_view_and_a_zero_row():
    """gate_up's rows may be strided (a view of a wider buffer); an all-zero row gets the floor scale, zero codes."""
    wide = _rows(3, 2 * 200 + 8, torch.bfloat16, 7)
    wide[1] = 0.0
    gate_up = wide[:, :400]
    q, scale = glu_quantize_tokens(gate_up)
    _same_codes((q, scale), quantize_tokens(silu_and_mul(gate_up.contiguous())))
    assert not q[1].float().any() and scale[1].item() < 1e-6


def test_rows_too_long_for_the_registers_are_refused_by_the_folds():
    x = torch.zeros(1, WHOLE_ROW_MAX_K + 16, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(AssertionError):
        norm_quantize_tokens(x, None, x[0], 1e-5)
    with pytest.raises(AssertionError):
        glu_quantize_tokens(torch.cat([x, x], dim=1))


def _fp8_linear(n: int, k: int, seed: int) -> Fp8Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Fp8Linear(k, n, False)
    q, scale = quantize_rows(torch.randn(n, k, generator=gen) * 0.02)
    layer.weight.data.copy_(q)
    layer.weight_scale.data.copy_(scale)
    return layer.to(DEVICE)


def test_on_the_cpu_no_path_folds():
    """The dequantizing path (CPU) quantizes nothing, so neither fold applies there."""
    layer = _fp8_linear(64, 128, 0).cpu()
    x = torch.zeros(32, 128, dtype=torch.bfloat16)
    assert not layer.folds(x, norm=True) and not layer.folds(x)
    assert not layer.takes_glu_input(torch.zeros(32, 256, dtype=torch.bfloat16))


def test_fp8_linear_folds_on_the_split_gemm_of_fp8_activations(monkeypatch):
    """The split GEMM on FP8 activations (the path of 17-64 rows on CUDA, forced here in the interpreter): the norm
    folds and the SwiGLU is taken, the same output as the unfused path bit for bit; the W8A16 split GEMM (no
    activation quantization) folds neither."""
    layer = _fp8_linear(48, 64, 1)
    x, weight, residual = (_rows(17, 64, torch.bfloat16, s) for s in (1, 2, 3))
    weight = weight[0]
    gate_up = _rows(17, 128, torch.bfloat16, 4)
    monkeypatch.setattr(Fp8Linear, "_path", lambda self, x: SplitW8a8(SplitTiles(block_n=16, block_k=32)))
    assert layer.folds(x, norm=True) and not layer.folds(x) and layer.takes_glu_input(gate_up)
    y, next_residual = layer.fused_linear(x, norm=(residual, weight, 1e-5))
    normed, want_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(next_residual, want_residual) and torch.equal(y, layer.linear(normed))
    assert torch.equal(layer.glu_input_linear(gate_up), layer.linear(silu_and_mul(gate_up)))
    monkeypatch.setattr(Fp8Linear, "_path", lambda self, x: SplitTiles(block_n=16, block_k=32))
    assert not layer.folds(x, norm=True) and not layer.takes_glu_input(gate_up)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,k", [(64, 4096), (32, 14336), (7, 16384 + 37)])
def test_the_kernels_on_the_gpu(m, k):
    x, weight = _rows(m, k, torch.bfloat16, 1), _rows(1, k, torch.bfloat16, 2)[0]
    if k <= WHOLE_ROW_MAX_K:
        residual = _rows(m, k, torch.bfloat16, 3)
        q, scale, next_residual = norm_quantize_tokens(x, residual, weight, 1e-5)
        normed, want_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        assert torch.equal(next_residual, want_residual)
        _same_codes((q, scale), quantize_tokens(normed))
        gate_up = _rows(m, 2 * k, torch.bfloat16, 4)
        _same_codes(glu_quantize_tokens(gate_up), quantize_tokens(silu_and_mul(gate_up)))
    q, scale = quantize_tokens(x)  # rows past WHOLE_ROW_MAX_K: read in pieces
    want = (x.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX)
    torch.testing.assert_close(scale, want, rtol=1e-6, atol=0)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [17, 32, 64])
def test_fp8_linear_folds_equal_its_unfused_path(m):
    """The 8B's o_proj shape (N > 3072, so the split GEMM on FP8 activations at 17-64 rows): the norm fold equals
    the norm kernel then linear, the SwiGLU fold silu_and_mul then linear, bit for bit."""
    layer = _fp8_linear(4096, 4096, m)
    x, weight, residual = (_rows(m, 4096, torch.bfloat16, s) for s in (1, 2, 3))
    weight = weight[0]
    assert layer.folds(x, norm=True) and not layer.folds(x)
    y, next_residual = layer.fused_linear(x, norm=(residual, weight, 1e-5))
    normed, want_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(next_residual, want_residual) and torch.equal(y, layer.linear(normed))
    gate_up = _rows(m, 8192, torch.bfloat16, 4)
    assert layer.takes_glu_input(gate_up)
    assert torch.equal(layer.glu_input_linear(gate_up), layer.linear(silu_and_mul(gate_up)))
    assert not layer.takes_glu_input(gate_up[:, :4096])
