"""The Triton small-batch linear (kernels/gemv.py) against a float64 reference, and its dispatch rule.

CPU: under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; GPU (`-m gpu`): the real projection
shapes of the three public models, against F.linear.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels import fused  # noqa: E402
from ostinato.kernels.gemv import (GemvTiles, NORM_FOLD_MAX_K, choose_gemv_tiles, gemv_linear,  # noqa: E402
                                 gemv_norm_linear, small_batch_linear, small_batch_norm_linear)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


# Shapes not multiples of the tiles (masked rows and columns), M below and at its padded size, with bias.
# peel_first with K inside one tile, across several and with a remainder; also K below a tile.
@pytest.mark.parametrize("m,n,k,tiles,bias", [
    (1, 37, 100, GemvTiles(4, 32), False),
    (3, 64, 96, GemvTiles(8, 32), True),
    (4, 5, 40, GemvTiles(1, 16), True),
    (2, 48, 1030, GemvTiles(2, 256), False),
    (1, 37, 100, GemvTiles(4, 32, peel_first=True), True),
    (3, 20, 24, GemvTiles(2, 32, peel_first=True), False),
    (1, 48, 1030, GemvTiles(2, 256, peel_first=True), False),
    (4, 9, 64, GemvTiles(8, 64, peel_first=True), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_matches_float64_reference(m, n, k, tiles, bias, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = gemv_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), tiles)
    assert out.shape == (m, n) and out.dtype == dtype
    ref = _reference(x, w, b)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.cpu().double(), ref, rtol=tol, atol=tol * k ** 0.5)


def test_gemv_writes_float32_when_asked():
    x = torch.randn(1, 64).to(torch.bfloat16)
    w = torch.randn(20, 64).to(torch.bfloat16)
    out = gemv_linear(x.to(DEVICE), w.to(DEVICE), None, GemvTiles(4, 32), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), _reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_tile_rule_is_the_measured_one():
    # M == 1 up to 8192 outputs, ~768-1024 programs; wider layers stay on cuBLAS. The first K step peeled
    # up to K = 3072 only.
    assert choose_gemv_tiles(1, 1024, 2048) == GemvTiles(1, 1024, peel_first=True)
    assert choose_gemv_tiles(1, 2048, 8192) == GemvTiles(2, 1024)
    assert choose_gemv_tiles(1, 4096, 1024) == GemvTiles(4, 1024, peel_first=True)
    assert choose_gemv_tiles(1, 6144, 4096) == GemvTiles(8, 1024)
    assert choose_gemv_tiles(1, 16384, 2048) is None
    # With PDL the wide ones too (the harness measured GemvTiles(8, 1024) there).
    assert choose_gemv_tiles(1, 16384, 2048, pdl=True) == GemvTiles(8, 1024, peel_first=True)
    assert choose_gemv_tiles(1, 28672, 4096, pdl=True) == GemvTiles(8, 1024)
    assert choose_gemv_tiles(8, 1024, 1024, pdl=True) is None
    # 2-4 rows: only narrow outputs.
    assert choose_gemv_tiles(4, 1024, 3072) == GemvTiles(2, 1024, peel_first=True)
    assert choose_gemv_tiles(4, 2048, 2048) is None
    assert choose_gemv_tiles(8, 1024, 1024) is None


def test_small_batch_linear_dispatch():
    layer = torch.nn.Linear(64, 40, bias=True).to(torch.bfloat16).to(DEVICE)
    x1 = torch.randn(1, 64).to(torch.bfloat16).to(DEVICE)
    x17 = torch.randn(17, 64).to(torch.bfloat16).to(DEVICE)
    # 17 rows (more than the GEMV's or the few-rows kernel's, kernels/skinny.py, whose own test covers 2-16):
    # cuBLAS, bit for bit what F.linear gives.
    assert torch.equal(small_batch_linear(x17, layer), F.linear(x17, layer.weight, layer.bias))
    # 1 row: the kernel, equal to the reference within bf16 rounding.
    torch.testing.assert_close(small_batch_linear(x1, layer).cpu().double(),
                               _reference(x1.cpu(), layer.weight.cpu(), layer.bias.cpu()), rtol=1e-2, atol=2e-2)
    # fp32 models always take F.linear.
    layer32 = torch.nn.Linear(64, 40).to(DEVICE)
    x = torch.randn(1, 64, device=DEVICE)
    assert torch.equal(small_batch_linear(x, layer32), F.linear(x, layer32.weight, layer32.bias))


# ---- the norm folded in -----------------------------------------------------------------------------------

FOLD_CASES = [  # (m, n, k, tiles): one K step, several with a remainder, peeled or not, M padded
    (1, 37, 100, GemvTiles(4, 32)),
    (3, 20, 70, GemvTiles(2, 32, peel_first=True)),
    (1, 48, 130, GemvTiles(2, 64, peel_first=True)),
    (4, 9, 64, GemvTiles(8, 64)),
]


def _fold_inputs(m, k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(m, k, generator=gen).to(dtype).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    return x, residual, norm_weight


@pytest.mark.parametrize("m,n,k,tiles", FOLD_CASES)
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_fold_is_the_norm_kernel_then_the_gemv(m, n, k, tiles, with_residual, dtype):
    """rmsnorm(x + residual) * w folded into the projection: the values of fused_add_rms_norm (rms_norm without
    a residual) then gemv_linear, and the residual sum bit for bit (program 0 writes it, every program reads)."""
    x, residual, norm_weight = _fold_inputs(m, k, dtype, m * 100 + k)
    w = (torch.randn(n, k) * 0.1).to(dtype).to(DEVICE)
    residual = residual if with_residual else None
    out, new_residual = gemv_norm_linear(x, residual, norm_weight, 1e-6, w, None, tiles)
    if residual is None:
        normed, expected_residual = fused.rms_norm(x, norm_weight, 1e-6), x
    else:
        normed, expected_residual = fused.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    assert (new_residual is x) == (residual is None)  # no copy when there is nothing to add
    expected = gemv_linear(normed, w, None, tiles)
    # The same roundings in the same order: bit for bit under the interpreter. On the GPU the norm's sum of
    # squares may reduce in another order than the norm kernel's (a 1-ulp change of a normalised value).
    if DEVICE == "cpu":
        assert torch.equal(out, expected)
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    assert x.abs().sum() > 0 and out.abs().sum() > 0


def test_norm_fold_takes_the_8b_row_with_its_first_k_step_peeled():
    """K 4096 (Llama-3.1-8B's qkv_proj and gate_up_proj): the plain GEMV does not peel there, the fold does, and
    gives the values of the norm kernel then the plain GEMV."""
    assert not choose_gemv_tiles(1, 8, 4096).peel_first
    layer = torch.nn.Linear(4096, 8, bias=False).to(torch.bfloat16).to(DEVICE)
    x, residual, norm_weight = _fold_inputs(1, 4096, torch.bfloat16, 4)
    folded = small_batch_norm_linear(x, residual, norm_weight, 1e-6, layer)
    assert folded is not None
    normed, expected_residual = fused.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(folded[1], expected_residual)
    expected = small_batch_linear(normed, layer)
    if DEVICE == "cpu":
        assert torch.equal(folded[0], expected)
    else:
        torch.testing.assert_close(folded[0].float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_norm_fold_takes_only_the_gemv_shapes():
    """Where the GEMV does not take the projection (rows cuBLAS takes, fp32, a row-parallel layer) or a row is
    too wide to hold, the fold answers None and the kernel set launches the norm and the projection apart,
    same values."""
    layer = torch.nn.Linear(64, 40, bias=False).to(torch.bfloat16).to(DEVICE)
    x1, r1, nw = _fold_inputs(1, 64, torch.bfloat16, 1)
    x8, r8, _ = _fold_inputs(8, 64, torch.bfloat16, 2)
    assert small_batch_norm_linear(x1, r1, nw, 1e-6, layer) is not None
    assert small_batch_norm_linear(x8, r8, nw, 1e-6, layer) is None  # 8 rows: cuBLAS
    layer32 = torch.nn.Linear(64, 40).to(DEVICE)
    assert small_batch_norm_linear(x1.float(), r1.float(), nw.float(), 1e-6, layer32) is None
    wide = torch.nn.Linear(NORM_FOLD_MAX_K * 2, 8, bias=False).to(torch.bfloat16).to(DEVICE)
    xw, rw, nww = _fold_inputs(1, NORM_FOLD_MAX_K * 2, torch.bfloat16, 3)
    assert small_batch_norm_linear(xw, rw, nww, 1e-6, wide) is None

    class RowParallel(torch.nn.Linear):
        tp = type("TP", (), {"world_size": 2})()

    assert small_batch_norm_linear(x1, r1, nw, 1e-6, RowParallel(64, 40).to(torch.bfloat16).to(DEVICE)) is None
    # The kernel set's fallback: the norm kernel then the projection, the residual its sum.
    kernels = fused.TRITON_KERNELS
    out, residual = kernels.norm_then_linear(x8, r8, nw, 1e-6, layer)
    normed, expected_residual = fused.fused_add_rms_norm(x8, r8, nw, 1e-6)
    assert torch.equal(residual, expected_residual) and torch.equal(out, small_batch_linear(normed, layer))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (3072, 2048),
                                 (2048, 2048), (2048, 8192), (6144, 4096), (4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("m", [1, 4])
def test_gemv_at_the_real_projection_shapes(m, n, k):
    tiles = choose_gemv_tiles(m, n, k) or GemvTiles(2, 1024)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    out = gemv_linear(x, w, None, tiles).float()
    ref = F.linear(x.float(), w.float())
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n,k", [(4096, 1024), (6144, 1024), (3072, 2048), (16384, 2048),  # qwen3, 1B: qkv, gate_up
                                 (6144, 4096), (28672, 4096)])  # 8B: qkv, gate_up
def test_norm_fold_at_the_real_shapes(n, k):
    """Batch 1, where the GEMV (with PDL) takes the projections the fold applies to, with the tiles the decoder
    folds them with (the first K step peeled, also at the 8B's K)."""
    x, residual, norm_weight = (t.cuda() for t in _fold_inputs(1, k, torch.bfloat16, 7))
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    tiles = choose_gemv_tiles(1, n, k, pdl=True)
    folded_tiles = GemvTiles(tiles.block_n, tiles.block_k, tiles.num_warps, tiles.num_stages, peel_first=True)
    out, new_residual = gemv_norm_linear(x, residual, norm_weight, 1e-6, w, None, folded_tiles, pdl=True)
    normed, expected_residual = fused.fused_add_rms_norm(x, residual, norm_weight, 1e-6)
    assert torch.equal(new_residual, expected_residual)
    expected = gemv_linear(normed, w, None, tiles).float()
    assert ((out.float() - expected).norm() / expected.norm()).item() < 1e-2
