"""The RMSNorm and the SwiGLU folded into the GGUF activations' quantization (kernels/gguf_int8_input.py): on the
GPU where there is one, else under the Triton interpreter, one kernel gives what the norm kernel (or the
SiLU-and-mul kernel, kernels/fused.py) and the quantizing kernel give one after the other (the residual bit for
bit, the norm's codes but for a rare tie the reduction order moves, the SwiGLU's codes exactly), and the
projections fed from it what they give fed those rows; the decoder's norm_then_linear and norm_then_mlp take
that path on CUDA exactly where every part of the projection takes integer dot products."""

import numpy as np
import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("triton")

from ostinato.kernels import gguf_gemv  # noqa: E402
from ostinato.kernels.fused import fused_add_rms_norm, rms_norm, silu_and_mul  # noqa: E402
from ostinato.kernels.gguf_int8_dot import quantize_x  # noqa: E402
from ostinato.kernels.gguf_int8_input import glu_quantize_x, norm_quantize_x  # noqa: E402
from ostinato.kernels.gguf_linear import Q4_0, Q4_K, Q6_K, Q8_0, GGUFConcat, GGUFLinear, device_rows  # noqa: E402
from ostinato.tools.checkpoint_gguf import random_blocks  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-5


def _rows(m: int, k: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(m, k, generator=g)).to(torch.bfloat16).to(DEV)


def _file_rows(k: int, types=((Q4_K, "Q4_K", 7), (Q6_K, "Q6_K", 5))):
    return [(torch.from_numpy(random_blocks(name, n, k, np.random.default_rng(n))), qtype) for qtype, name, n in types]


def _parts(k: int):
    """The kernels' parts (rows as device_rows gives them)."""
    return [(device_rows(blocks, qtype).to(DEV), qtype, None) for blocks, qtype in _file_rows(k)]


def _same_quantization(got, want):
    codes_got, codes_want = (q.xq.cpu().view(torch.int8).float() for q in (got, want))
    assert (codes_got - codes_want).abs().max() <= 1 and (codes_got != codes_want).float().mean() < 2e-3
    for a, b in zip(got[1:], want[1:]):  # dx, sx, cx, s16
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2 * b.abs().max().item())


@pytest.mark.parametrize("with_residual", [True, False])
def test_one_kernel_gives_the_norm_then_the_quantization(with_residual):
    m, k = 3, 768
    x = torch.cat([_rows(m, k, 0), _rows(m, 64, 9)], dim=1)[:, :k]  # strided rows
    residual = _rows(m, k, 1, scale=4.0) if with_residual else None
    weight = _rows(1, k, 2)[0].abs() + 0.5
    got, got_residual = norm_quantize_x(x, residual, weight, EPS)
    if with_residual:
        normed, want_residual = fused_add_rms_norm(x, residual, weight, EPS)
        torch.testing.assert_close(got_residual, want_residual, rtol=0, atol=0)
    else:
        normed = rms_norm(x, weight, EPS)
        assert got_residual is x
    _same_quantization(got, quantize_x(normed))


def test_a_projection_fed_from_it_gives_what_the_normed_rows_give():
    k = 512
    x, residual = _rows(1, k, 3), _rows(1, k, 4)
    weight = _rows(1, k, 5)[0].abs() + 0.5
    parts = _parts(k)
    out, new_residual = gguf_gemv.gguf_norm_linear(x, (residual, weight, EPS), parts)
    normed, want_residual = fused_add_rms_norm(x, residual, weight, EPS)
    want = torch.empty_like(out)
    gguf_gemv.gguf_concat_into(normed, parts, want)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())


def test_it_folds_where_every_part_takes_integer_dot_products():
    k = 512
    one, two = torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(2, k, dtype=torch.bfloat16)
    assert gguf_gemv.quantization_folds(one, [Q4_K, Q6_K]) and gguf_gemv.quantization_folds(two, [Q8_0])
    assert gguf_gemv.quantization_folds(one, [Q4_K, Q8_0])
    assert not gguf_gemv.quantization_folds(one, [Q4_K, Q4_0])  # Q4_0 has no integer-dot kernel
    assert not gguf_gemv.quantization_folds(one.float(), [Q4_K])
    assert gguf_gemv.quantization_folds(torch.zeros(16, k, dtype=torch.bfloat16), [Q4_K, Q6_K])  # the MMA kernels'
    assert not gguf_gemv.quantization_folds(torch.zeros(17, k, dtype=torch.bfloat16), [Q4_K])  # x unquantized above
    layer = GGUFLinear(Q4_K, torch.from_numpy(random_blocks("Q4_K", 4, k, np.random.default_rng(0))), k)
    assert not layer.folds(one, norm=True)  # a CPU tensor: the torch path, no kernel to fold into
    assert not layer.folds(one)  # never the activation after it
    assert not layer.takes_glu_input(torch.zeros(1, 2 * k, dtype=torch.bfloat16))  # nor on a CPU tensor


@pytest.mark.parametrize("m", [1, 3])
def test_one_kernel_gives_the_swiglu_then_the_quantization(m):
    k = 768
    gate_up = torch.cat([_rows(m, 2 * k, 10, scale=3.0), _rows(m, 64, 11)], dim=1)[:, :2 * k]  # strided rows
    got, want = glu_quantize_x(gate_up), quantize_x(silu_and_mul(gate_up))
    for a, b in zip(got, want):  # the same values quantized the same way: every field bit for bit
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_projection_fed_from_the_swiglu_gives_what_the_activated_rows_give():
    k = 512
    gate_up = _rows(2, 2 * k, 12, scale=3.0)
    parts = _parts(k)
    out = gguf_gemv.gguf_glu_linear(gate_up, parts)
    want = torch.empty_like(out)
    gguf_gemv.gguf_concat_into(silu_and_mul(gate_up), parts, want)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4])
def test_the_decoder_norm_then_linear_takes_the_fold_on_cuda(m, monkeypatch):
    from ostinato.kernels.fused import TRITON_KERNELS_PDL

    k = 512
    layer = GGUFConcat([GGUFLinear(qtype, blocks, k) for blocks, qtype in _file_rows(k)]).to(DEV)
    x, residual = _rows(m, k, 6), _rows(m, k, 7)
    weight = _rows(1, k, 8)[0].abs() + 0.5
    folded = []
    monkeypatch.setattr(gguf_gemv, "norm_quantize_x",
                        lambda *a, **kw: folded.append(a[0].shape) or norm_quantize_x(*a, **kw))
    out, new_residual = TRITON_KERNELS_PDL.norm_then_linear(x, residual, weight, EPS, layer)
    assert folded == [x.shape]
    normed, want_residual = fused_add_rms_norm(x, residual, weight, EPS)
    want = layer.linear(normed)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), want.float(), rtol=0, atol=2e-2 * want.float().abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4])
def test_the_decoder_mlp_takes_the_swiglu_fold_on_cuda(m, monkeypatch):
    from ostinato.kernels import gguf_int8_input
    from ostinato.kernels.fused import TRITON_KERNELS_PDL

    k, inter = 512, 768
    gate_up = GGUFLinear(Q4_K, torch.from_numpy(random_blocks("Q4_K", 2 * inter, k, np.random.default_rng(1))),
                         k).to(DEV)
    down = GGUFConcat([GGUFLinear(qtype, blocks, inter) for blocks, qtype in _file_rows(inter)]).to(DEV)
    x, residual = _rows(m, k, 13), _rows(m, k, 14)
    weight = _rows(1, k, 15)[0].abs() + 0.5
    folded = []
    monkeypatch.setattr(gguf_gemv, "glu_quantize_x",
                        lambda *a, **kw: folded.append(a[0].shape) or gguf_int8_input.glu_quantize_x(*a, **kw))
    out, new_residual = TRITON_KERNELS_PDL.norm_then_mlp(x, residual, weight, EPS, gate_up, down)
    assert folded == [(m, 2 * inter)]
    h, want_residual = TRITON_KERNELS_PDL.norm_then_linear(x, residual, weight, EPS, gate_up)
    torch.testing.assert_close(new_residual, want_residual, rtol=0, atol=0)
    torch.testing.assert_close(out, down.linear(silu_and_mul(h)), rtol=0, atol=0)
