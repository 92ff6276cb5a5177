"""The Triton small-batch linear (model/gemv.py) against a float64 reference, and its dispatch rule.

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

from ostinato.model.gemv import GemvTiles, choose_gemv_tiles, gemv_linear, small_batch_linear  # noqa: E402

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
    x8 = torch.randn(8, 64).to(torch.bfloat16).to(DEVICE)
    # 8 rows: cuBLAS, bit for bit what F.linear gives.
    assert torch.equal(small_batch_linear(x8, layer), F.linear(x8, layer.weight, layer.bias))
    # 1 row: the kernel, equal to the reference within bf16 rounding.
    torch.testing.assert_close(small_batch_linear(x1, layer).cpu().double(),
                               _reference(x1.cpu(), layer.weight.cpu(), layer.bias.cpu()), rtol=1e-2, atol=2e-2)
    # fp32 models always take F.linear.
    layer32 = torch.nn.Linear(64, 40).to(DEVICE)
    x = torch.randn(1, 64, device=DEVICE)
    assert torch.equal(small_batch_linear(x, layer32), F.linear(x, layer32.weight, layer32.bias))


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
