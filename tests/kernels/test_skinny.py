"""The tensor-core linear for a few rows (kernels/skinny.py) against a float64 reference, and its dispatch.

CPU: under TRITON_INTERPRET=1 (tests/conftest.py) at small shapes; GPU (`-m gpu`): the real projection shapes of
the three public models at 2-16 rows, against F.linear, plain and with PDL inside a CUDA graph.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels import gemv, skinny  # noqa: E402
from ostinato.kernels.skinny import SkinnyTiles, skinny_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double())


def _check(out, x, w, b, dtype):
    assert out.shape == (x.shape[0], w.shape[0]) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.cpu().double(), _reference(x, w, b), rtol=tol, atol=tol * x.shape[1] ** 0.5)


# Rows from 2 to 16 (padded to 16), N and K not multiples of the tiles (masked rows and columns), K inside one
# tile and across several with a remainder, with and without bias.
@pytest.mark.parametrize("m,n,k,tiles,bias", [
    (2, 37, 100, SkinnyTiles(16, 32), False),
    (5, 64, 96, SkinnyTiles(32, 32, num_stages=2), True),
    (16, 20, 24, SkinnyTiles(16, 32), True),
    (9, 48, 300, SkinnyTiles(16, 64, num_stages=3), False),
    (3, 16, 16, SkinnyTiles(16, 16), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_matches_float64_reference(m, n, k, tiles, bias, dtype):
    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = torch.randn(n, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    out = skinny_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), tiles)
    _check(out, x, w, b, dtype)


def test_skinny_reads_strided_rows_and_writes_float32_when_asked():
    # x a row slice of a wider buffer (stride(0) > K), as the decoder's activations can be.
    wide = torch.randn(6, 80).to(torch.bfloat16)
    x = wide[:, :64]
    w = torch.randn(24, 64).to(torch.bfloat16)
    out = skinny_linear(x.to(DEVICE), w.to(DEVICE), None, SkinnyTiles(16, 32), out_dtype=torch.float32)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu().double(), _reference(x, w, None), rtol=1e-5, atol=1e-4)


def test_small_batch_linear_takes_the_rows_the_rule_gives_it(monkeypatch):
    """The dispatch: the GEMV's shapes stay the GEMV's, rows the skinny rule accepts go to skinny_linear, and
    the rest, or more than MAX_ROWS rows, to the layer's own forward."""
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "choose_skinny_tiles",
                        lambda m, n, k, pdl=False: SkinnyTiles(16, 32) if m > 1 else None)
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    layer = torch.nn.Linear(64, 40, bias=True).to(DEVICE, torch.bfloat16)
    for m in (1, 6, 16, 17):
        x = torch.randn(m, 64, device=DEVICE).to(torch.bfloat16)
        out = gemv.small_batch_linear(x, layer)
        _check(out, x.cpu(), layer.weight.detach().cpu(), layer.bias.detach().cpu(), torch.bfloat16)
    assert calls == [6, 16]  # m 1: the GEMV; m 17: above MAX_ROWS, cuBLAS (the layer's forward)


def test_the_rule_is_the_measured_one():
    # Qwen3-0.6B's projections (one side 1024, the other <= 6144) at 2-16 rows; the measured tiles per row count.
    # And Llama-3.2-1B's qkv_proj (3072 x 2048), measured one projection at a time.
    for n, k in ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (3072, 2048)):
        assert skinny.choose_skinny_tiles(4, n, k) == SkinnyTiles(16, 512, num_stages=3)
        assert skinny.choose_skinny_tiles(8, n, k) == SkinnyTiles(32, 256, num_stages=3)
        assert skinny.choose_skinny_tiles(16, n, k) == SkinnyTiles(16, 256, num_stages=4)
    assert skinny.choose_skinny_tiles(2, 4096, 1024) == SkinnyTiles(16, 512, num_stages=3)
    # One row is the GEMV's, more than 16 a GEMM's; the 1B's other projections and the 8B's stay on cuBLAS.
    assert skinny.choose_skinny_tiles(1, 4096, 1024) is None
    assert skinny.choose_skinny_tiles(17, 4096, 1024) is None
    for n, k in ((2048, 2048), (16384, 2048), (2048, 8192), (6144, 4096), (4096, 4096), (28672, 4096),
                 (4096, 14336)):
        assert skinny.choose_skinny_tiles(8, n, k) is None


def test_qwen3_projections_of_a_few_rows_run_skinny(monkeypatch):
    """Through the decoder's entry point: 8 rows of Qwen3-0.6B's qkv_proj shape (1024 -> 4096) go to
    skinny_linear with the rule's tiles."""
    calls = []
    real = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **kw: calls.append(a[3]) or real(*a, **kw))
    layer = torch.nn.Linear(1024, 4096, bias=False).to(DEVICE, torch.bfloat16)
    x = torch.randn(8, 1024, device=DEVICE).to(torch.bfloat16)
    out = gemv.small_batch_linear(x, layer)
    _check(out, x.cpu(), layer.weight.detach().cpu(), None, torch.bfloat16)
    assert calls == [SkinnyTiles(32, 256, num_stages=3)]  # tiles_for_rows(8), measured at batch 8


def test_only_the_folded_gate_up_above_8_rows_launches_without_pdl(monkeypatch):
    """skinny.keeps_pdl (measured): in a PDL step the (gate | up) projection with its activation folded in leaves
    PDL off at 9-16 rows; at 8 rows, and every projection without the fold, keeps it."""
    launched = []
    monkeypatch.setattr(skinny, "launch_options", lambda pdl: launched.append(pdl) or {})
    # Only the flag is under test: the launch itself is not run (the interpreter took seconds a call).
    monkeypatch.setattr(skinny.deferred_launch, "launch", lambda *args, **kwargs: None)
    layer = torch.nn.Linear(1024, 4096, bias=False).to(DEVICE, torch.bfloat16)
    for m, glu in ((16, True), (9, True), (8, True), (16, False)):
        x = torch.randn(m, 1024, device=DEVICE).to(torch.bfloat16)
        gemv.small_batch_linear(x, layer, pdl=True, glu=glu)
    assert launched == [False, False, True, True]
    launched.clear()
    gemv.small_batch_linear(torch.randn(16, 1024, device=DEVICE).to(torch.bfloat16), layer, pdl=False, glu=True)
    assert launched == [False]  # a step without PDL never gains it


# The real projection shapes (N, K) of Qwen3-0.6B, Llama-3.2-1B and Llama-3.1-8B.
REAL_SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (3072, 2048), (2048, 2048), (16384, 2048),
               (2048, 8192), (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", REAL_SHAPES)
@pytest.mark.parametrize("m", [2, 4, 8, 16])
def test_skinny_at_the_real_projection_shapes(m, n, k):
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    for tiles in (SkinnyTiles(), SkinnyTiles(16, 512, num_stages=3), SkinnyTiles(32, 256, num_stages=3),
                  SkinnyTiles(16, 256, num_stages=4)):
        out = skinny_linear(x, w, None, tiles)
        ref = F.linear(x.float(), w.float())
        assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_skinny_with_pdl_in_a_graph_equals_plain_launches():
    """Weight tiles read before the PDL wait, x after it: in a graph of dependent launches (each layer's x the
    previous one's output), the results equal plain launches bit for bit, with new inputs
    between replays."""
    from ostinato.kernels.pdl import pdl_unsupported_reason

    if pdl_unsupported_reason(torch.device("cuda")):
        pytest.skip(pdl_unsupported_reason(torch.device("cuda")))
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(torch.randn(2048, 2048, device="cuda", generator=gen) / 45).to(torch.bfloat16) for _ in range(6)]
    x = torch.randn(8, 2048, device="cuda", generator=gen).to(torch.bfloat16)

    def chain(pdl):
        h = x
        for w in ws:
            h = skinny_linear(h, w, None, SkinnyTiles(), pdl=pdl)
        return h

    chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(True)
    for _ in range(20):
        x.copy_(torch.randn(8, 2048, device="cuda", generator=gen).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(out, chain(False))
