"""The streaming FP8 GEMV (kernels/fp8_stream.py) against a float64 dequantize-then-matmul reference: plain and with
the SwiGLU after it folded in; ragged N, K past one tile and not a multiple of it, 1-4 rows, both prefetch depths;
per-row and block scales (blocks narrower and wider than a K step, ragged at both edges).
CPU: under TRITON_INTERPRET=1 (tests/conftest.py), which takes the kernel's plain byte-unpacking path; the GPU
test runs the inline-PTX conversion at a real shape."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels import fp8_linear, fused  # noqa: E402
from ostinato.kernels.fp8_linear import FP8_DTYPE, FP8_MAX, Fp8Linear, dequantize_fp8  # noqa: E402
from ostinato.kernels.fp8_stream import (ResidualNorm, StreamTiles, fp8_stream, fp8_stream_then_norm,  # noqa: E402
                                         stream_takes)
from ostinato.kernels.fused_ref import fused_add_rms_norm_ref, silu_and_mul_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m, n, k, dtype, seed, bias=False):
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    return w, scale, x, b


def _reference(x, w, scale, b, block=None):
    return F.linear(x.double(), dequantize_fp8(w, scale, block).double(), None if b is None else b.double())


def _block_scales(n, k, block, seed):
    """A scale table [cdiv(N, bn), cdiv(K, bk)] whose blocks differ by up to 100x, so a misplaced block shows."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) ** 4 * 0.01 + 1e-4


def _dev(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def _close(out, ref, dtype):
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's own rounding
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


# N not a multiple of block_n; K inside one tile, across several, and not a multiple of a tile (the last words
# masked, also in the prefetch past the end).
@pytest.mark.parametrize("m,n,k,tiles,bias", [
    (1, 37, 96, StreamTiles(4, 32), False),
    (1, 37, 100, StreamTiles(4, 64, prefetch=2), True),
    (2, 21, 264, StreamTiles(8, 64), True),
    (3, 19, 128, StreamTiles(2, 32, prefetch=2), False),
    (4, 9, 68, StreamTiles(8, 16), True),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_stream_matches_float64_reference(m, n, k, tiles, bias, dtype):
    w, scale, x, b = _case(m, n, k, dtype, m * 1000 + n + k, bias)
    out = fp8_stream(*_dev(x, w, scale, b), tiles)
    assert out.shape == (m, n) and out.dtype == dtype
    _close(out, _reference(x, w, scale, b), dtype)


@pytest.mark.parametrize("m,n", [(1, 2 * 21), (4, 2 * 8)])
def test_stream_with_the_glu_folded_in(m, n):
    k, dtype = 96, torch.bfloat16
    w, scale, x, b = _case(m, n, k, dtype, 3 + m, bias=True)
    out = fp8_stream(*_dev(x, w, scale, b), StreamTiles(8, 32), glu=True)
    assert out.shape == (m, n // 2)
    gate_up = _reference(x, w, scale, b).to(dtype)  # the projection's output as the unfused path stores it
    ref = silu_and_mul_ref(gate_up).double()
    _close(out, ref, dtype)


# Blocks narrower than a K step (several a step) and wider (one across steps); N and K not multiples of the block
# (or of the step), and a K of whole steps.
@pytest.mark.parametrize("m,n,k,block,tiles", [
    (1, 37, 100, (8, 16), StreamTiles(4, 64, prefetch=2)),
    (2, 21, 264, (4, 128), StreamTiles(8, 32)),
    (4, 19, 136, (16, 12), StreamTiles(2, 32)),
    (3, 24, 256, (8, 32), StreamTiles(4, 64, prefetch=2)),  # K a multiple of the step: the scalar clamp
])
def test_stream_with_block_scales_matches_float64_reference(m, n, k, block, tiles):
    w, _, x, b = _case(m, n, k, torch.bfloat16, 5 * m + n, bias=True)
    scale = _block_scales(n, k, block, m)
    out = fp8_stream(*_dev(x, w, scale, b), tiles, block=block)
    _close(out, _reference(x, w, scale, b, block), torch.bfloat16)


# 2 x 16 rows: each program's gate rows in one row block, its up rows in another (the scales read once for all a
# half's rows); 2 x 20: the up half starts inside a row block, so each row reads its own.
@pytest.mark.parametrize("n", [2 * 16, 2 * 20])
def test_stream_with_block_scales_and_the_glu(n):
    """The SwiGLU after, on a gate | up weight whose scale table covers both halves."""
    m, k, block = 1, 72, (8, 8)
    w, _, x, _ = _case(m, n, k, torch.bfloat16, 17)
    scale = _block_scales(n, k, block, 4)
    out = fp8_stream(*_dev(x, w, scale), None, StreamTiles(4, 32), glu=True, block=block)
    gate_up = _reference(x, w, scale, None, block).to(torch.bfloat16)
    _close(out, silu_and_mul_ref(gate_up).double(), torch.bfloat16)


def test_stream_takes_only_what_it_can_read_as_words():
    w = torch.zeros(8, 64, dtype=FP8_DTYPE)
    assert stream_takes(torch.zeros(4, 64, dtype=torch.bfloat16), w)
    assert not stream_takes(torch.zeros(5, 64, dtype=torch.bfloat16), w)  # more rows than accumulators
    assert not stream_takes(torch.zeros(1, 62, dtype=torch.bfloat16), torch.zeros(8, 62, dtype=FP8_DTYPE))
    assert not stream_takes(torch.zeros(1, 64, dtype=torch.float32), w)
    assert not stream_takes(torch.zeros(2, 66, dtype=torch.bfloat16)[:, 1:65], w)  # rows not word-aligned
    assert stream_takes(torch.zeros(1, 64, dtype=torch.bfloat16), w, (128, 128))
    assert not stream_takes(torch.zeros(1, 64, dtype=torch.bfloat16), w, (8, 6))  # a word across two blocks


@pytest.mark.parametrize("m,n,tiles", [(1, 37, StreamTiles(4, 32)), (3, 64, StreamTiles(8, 64, prefetch=2))])
def test_stream_then_norm_matches_the_norm_kernels_inputs(m, n, tiles):
    """The residual add and RMSNorm after the projection, by the program that counts in last: the sum is the
    projection's output rounded to bf16 plus the residual, rounded (exactly the norm kernel's input), and the
    normed rows the norm kernel's of that sum (and close to the torch norm's). Launched twice with one counter,
    which must be zero again after each launch: left non-zero, no program of the next launch would be last."""
    k, dtype = 96, torch.bfloat16
    w, scale, x, _ = _case(m, n, k, dtype, 7 + m)
    gen = torch.Generator().manual_seed(m)
    residual = torch.randn(m, n, generator=gen).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    y = _reference(x, w, scale, None).to(dtype)
    expect_normed, expect_sum = fused_add_rms_norm_ref(y, residual, norm_weight, 1e-6)
    for _ in range(2):
        norm = ResidualNorm(*_dev(residual, norm_weight), 1e-6, counter)
        normed, total = fp8_stream_then_norm(*_dev(x, w, scale), None, tiles, norm)
        torch.testing.assert_close(total.cpu(), expect_sum, rtol=0, atol=0.02 * expect_sum.abs().max().item())
        expect = fused.rms_norm(total, norm_weight.to(DEVICE), 1e-6)  # the norm kernel on the same sum
        torch.testing.assert_close(normed, expect, rtol=0, atol=0)
        torch.testing.assert_close(normed.cpu(), expect_normed, rtol=0.02, atol=0.02)
        assert counter.item() == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4])
def test_stream_at_a_real_shape_with_pdl(m):
    w, scale, x, _ = _case(m, 4096, 4096, torch.bfloat16, m)
    out = fp8_stream(*_dev(x, w, scale), None, StreamTiles(8, 1024), pdl=True)
    _close(out, _reference(x, w, scale, None), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("k", [4096, 14336])
def test_stream_then_norm_at_a_real_shape_with_pdl(k):
    """The 8B's o_proj and down_proj (512 programs a launch): the sums and the last program's rows match the norm
    kernel's over the plain projection's output plus the residual, launch after launch on one counter (a slice
    read before its store was visible would show as a launch far off; a counter left set fails the last check)."""
    n = 4096
    w, scale, x, _ = _case(1, n, k, torch.bfloat16, k)
    x, w, scale = _dev(x, w, scale)
    gen = torch.Generator().manual_seed(k)
    residual, norm_weight = (torch.randn(1, n, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    tiles = StreamTiles(8, 2048)
    expect_normed, expect_sum = fused.fused_add_rms_norm(fp8_stream(x, w, scale, None, tiles), residual,
                                                         norm_weight, 1e-5)
    for _ in range(50):
        normed, total = fp8_stream_then_norm(x, w, scale, None, tiles, ResidualNorm(residual, norm_weight, 1e-5,
                                                                                    counter), pdl=True)
        # within a bf16 step of the largest: the two kernels' loops compile apart (a stale slice is garbage)
        torch.testing.assert_close(total, expect_sum, rtol=0, atol=2 ** -7 * expect_sum.abs().max().item())
        torch.testing.assert_close(normed, expect_normed, rtol=0, atol=2 ** -6 * expect_normed.abs().max().item())
    assert counter.item() == 0


def _fp8_layer(n, k, seed):
    w, scale, _, _ = _case(1, n, k, torch.bfloat16, seed)
    layer = Fp8Linear(k, n, bias=False)
    layer.weight.data.copy_(w)
    layer.weight_scale.data.copy_(scale)
    return layer.to(DEVICE)


@pytest.mark.parametrize("m", [1, 2])
def test_kernel_set_folds_the_activation_into_an_fp8_projection_and_keeps_the_norm_apart(m, monkeypatch):
    """DecoderKernels.norm_then_glu on an Fp8Linear (gate | up) on the streaming GEMV: the norm is its own kernel
    (kernels/fp8_stream.py says why), the projection and the activation one. The values are the unfused path's:
    the torch norm, the dequantized weight in float64, the torch activation. (On CPU the rule gives the
    dequantize path, so the streaming tiles are forced.)"""
    monkeypatch.setattr(fp8_linear, "choose_fp8_path", lambda m, n, k, *args, **kw: StreamTiles(4, 32))
    launched = []
    counting = dataclasses.replace(
        fused.TRITON_KERNELS, silu_and_mul=lambda t: launched.append("silu") or fused.silu_and_mul(t),
        fused_add_rms_norm=lambda *a: launched.append("norm") or fused.fused_add_rms_norm(*a))
    layer = _fp8_layer(2 * 24, 64, m)
    gen = torch.Generator().manual_seed(m)
    x, residual = (torch.randn(m, 64, generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16)
    act, new_residual = counting.norm_then_glu(*_dev(x, residual, norm_weight), 1e-6, layer)
    assert launched == ["norm"]
    normed, expect_residual = fused_add_rms_norm_ref(x, residual, norm_weight, 1e-6)
    gate_up = _reference(normed, layer.weight.cpu(), layer.weight_scale.cpu(), None).to(torch.bfloat16)
    torch.testing.assert_close(new_residual.cpu(), expect_residual, rtol=0, atol=0)
    _close(act, silu_and_mul_ref(gate_up).double(), torch.bfloat16)
