"""The SwiGLU activation folded into the (gate | up) projection's kernel (kernels/gemv.py, kernels/skinny.py,
kernels/linear_epilogue.py): silu(gate) * up out of the GEMV or the few-rows kernel, against a float64 reference
and against the unfused path (the projection, then kernels/fused.py's silu_and_mul), and its dispatch.

CPU: under TRITON_INTERPRET=1 at small shapes; GPU (`-m gpu`): the real gate_up shapes of the three public models.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels import fused, gemv  # noqa: E402
from ostinato.kernels.gemv import GemvTiles, gemv_linear, gemv_norm_linear  # noqa: E402
from ostinato.kernels.skinny import SkinnyTiles, skinny_linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _glu_reference(x, w, b):
    gate, up = F.linear(x.double(), w.double(), None if b is None else b.double()).chunk(2, dim=-1)
    return F.silu(gate) * up


def _inputs(m, n2, k, dtype, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n2, k, generator=gen) / k ** 0.5).to(dtype)
    b = torch.randn(n2, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(out, x, w, b, dtype):
    assert out.shape == (x.shape[0], w.shape[0] // 2) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: gate, up, silu and the product each rounded
    torch.testing.assert_close(out.cpu().double(), _glu_reference(x, w, b), rtol=tol, atol=tol)


# Outputs not a multiple of the programs' (masked pairs), block_n 1 (raised to 2 pairs), bias, peel.
@pytest.mark.parametrize("m,n2,k,tiles,bias", [
    (1, 40, 96, GemvTiles(1, 32), False),
    (3, 64, 130, GemvTiles(8, 32), True),
    (2, 22, 64, GemvTiles(2, 32, peel_first=True), False),
    (4, 18, 40, GemvTiles(4, 16, peel_first=True), True),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_glu_matches_float64_reference(m, n2, k, tiles, bias, dtype):
    x, w, b = _inputs(m, n2, k, dtype, bias, m * 100 + n2)
    out = gemv_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), tiles, glu=True)
    _check(out, x, w, b, dtype)


@pytest.mark.parametrize("m,n2,k,tiles,bias", [
    (2, 40, 96, SkinnyTiles(16, 32), False),
    (5, 64, 130, SkinnyTiles(32, 32), True),
    (16, 22, 64, SkinnyTiles(16, 16), True),
    (9, 100, 48, SkinnyTiles(64, 16, num_stages=2), False),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skinny_glu_matches_float64_reference(m, n2, k, tiles, bias, dtype):
    x, w, b = _inputs(m, n2, k, dtype, bias, m * 100 + n2 + 1)
    out = skinny_linear(x.to(DEVICE), w.to(DEVICE), None if b is None else b.to(DEVICE), tiles, glu=True)
    _check(out, x, w, b, dtype)


@pytest.mark.parametrize("with_residual", [True, False])
def test_norm_fold_with_glu_gives_the_unfused_values(with_residual):
    """Norm, projection and activation in one kernel against the norm-folded projection then the activation
    kernel (fp32: the same arithmetic in the same order but the interpreter's bf16 casts)."""
    gen = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(2, 96, generator=gen).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(96, generator=gen)).to(DEVICE)
    w = (torch.randn(80, 96, generator=gen) / 10).to(DEVICE)
    residual = residual if with_residual else None
    tiles = GemvTiles(4, 32, peel_first=True)
    act, new_residual = gemv_norm_linear(x, residual, norm_weight, 1e-6, w, None, tiles, glu=True)
    gate_up, expected_residual = gemv_norm_linear(x, residual, norm_weight, 1e-6, w, None, tiles)
    assert torch.equal(new_residual, expected_residual)
    torch.testing.assert_close(act, fused.silu_and_mul_ref(gate_up), rtol=1e-6, atol=1e-6)


def _rule_on(monkeypatch):
    monkeypatch.setattr(gemv, "choose_glu_fold", lambda m, n, k, pdl=False: True)


def test_the_fold_is_on_where_measured_to_win_and_only_where_a_kernel_takes_the_projection(monkeypatch):
    layer = torch.nn.Linear(64, 80, bias=False).to(torch.bfloat16).to(DEVICE)
    rows = {m: torch.randn(m, 64, device=DEVICE).to(torch.bfloat16) for m in (1, 8, 16, 17)}
    # the rule as measured: on wherever a Triton kernel takes the projection (1-16 rows; at 16 with the few-rows
    # kernel launched without PDL), off above 16 rows (cuBLAS)
    assert [gemv.folds_glu(x, layer) for x in rows.values()] == [True, True, True, False]
    _rule_on(monkeypatch)
    assert gemv.folds_glu(rows[16], layer)  # the few-rows kernel could take it
    assert gemv.folds_glu(rows[1], layer)  # the GEMV
    assert gemv.folds_glu(rows[8], layer)  # the few-rows kernel (its rule takes this shape)
    assert not gemv.folds_glu(rows[17], layer)  # cuBLAS
    assert not gemv.folds_glu(rows[1].float(), layer.float())  # fp32: no Triton projection
    odd = torch.nn.Linear(64, 81, bias=False).to(torch.bfloat16).to(DEVICE)
    assert not gemv.folds_glu(rows[1], odd)


@pytest.mark.parametrize("m", [1, 8])
def test_kernel_set_folds_the_activation_where_the_rule_says(m, monkeypatch):
    """DecoderKernels.norm_then_glu: with the rule on, no activation kernel, the unfused values (batch 1: the
    norm, the GEMV and the activation in one kernel; batch 8: the norm kernel, then the few-rows kernel with the
    activation)."""
    activations = []
    counting = dataclasses.replace(fused.TRITON_KERNELS, silu_and_mul=lambda t: activations.append(t.shape[0])
                                   or fused.silu_and_mul(t))
    layer = torch.nn.Linear(64, 80, bias=False).to(torch.bfloat16).to(DEVICE)
    gen = torch.Generator().manual_seed(m)
    x, residual = (torch.randn(m, 64, generator=gen).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    norm_weight = (1 + 0.1 * torch.randn(64, generator=gen)).to(torch.bfloat16).to(DEVICE)
    monkeypatch.setattr(gemv, "choose_glu_fold", lambda m, n, k, pdl=False: False)
    expected, expected_residual = counting.norm_then_glu(x, residual, norm_weight, 1e-6, layer)
    assert activations == [m]
    _rule_on(monkeypatch)
    act, new_residual = counting.norm_then_glu(x, residual, norm_weight, 1e-6, layer)
    assert activations == [m]  # none more
    assert torch.equal(new_residual, expected_residual)
    # One bf16 ulp apart at most: the interpreter's casts truncate where the fold rounds to nearest.
    torch.testing.assert_close(act.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("takes", [True, False])
def test_the_mlp_hands_the_activation_to_down_where_its_kernel_takes_it(takes):
    """DecoderKernels.norm_then_mlp with gate_up's fold off: where glu_linear takes (gate | up) for down, no
    activation kernel runs and down never sees the activated rows apart; where it declines (None), the activation
    kernel, then down, as before."""
    calls = []

    def glu_linear(h, layer):
        calls.append(("glu_linear", tuple(h.shape)))
        return F.linear(F.silu(h[:, :40]) * h[:, 40:], layer.weight) if takes else None

    kernels = dataclasses.replace(fused.TORCH_KERNELS, glu_linear=glu_linear,
                                  silu_and_mul=lambda t: calls.append(("silu_and_mul",)) or fused.silu_and_mul_ref(t))
    gate_up, down = torch.nn.Linear(64, 80, bias=False), torch.nn.Linear(40, 64, bias=False)
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(2, 64, generator=gen), torch.randn(2, 64, generator=gen)
    norm_weight = 1 + 0.1 * torch.randn(64, generator=gen)
    out, new_residual = kernels.norm_then_mlp(x, residual, norm_weight, 1e-6, gate_up, down)
    assert calls == [("glu_linear", (2, 80))] + ([] if takes else [("silu_and_mul",)])
    act, want_residual = fused.TORCH_KERNELS.norm_then_glu(x, residual, norm_weight, 1e-6, gate_up)
    torch.testing.assert_close(out, down(act))
    torch.testing.assert_close(new_residual, want_residual)


# The (gate | up) shapes of Qwen3-0.6B, Llama-3.2-1B and Llama-3.1-8B.
GATE_UP = [(6144, 1024), (16384, 2048), (28672, 4096)]


@pytest.mark.gpu
@pytest.mark.parametrize("n2,k", GATE_UP)
@pytest.mark.parametrize("m", [1, 4, 16])
def test_glu_fold_at_the_real_shapes(m, n2, k):
    """The fold against the same kernel unfused, then the activation kernel: the rule's tiles at 1 row (the
    GEMV with the norm folded, PDL), the few-rows kernel's at 4 and 16."""
    gen = torch.Generator(device="cuda").manual_seed(m + n2)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(n2, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
    if m == 1:
        residual = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)
        tiles = dataclasses.replace(gemv.choose_gemv_tiles(1, n2, k, pdl=True), peel_first=True)
        act, _ = gemv_norm_linear(x, residual, nw, 1e-6, w, None, tiles, pdl=True, glu=True)
        gate_up, _ = gemv_norm_linear(x, residual, nw, 1e-6, w, None, tiles, pdl=True)
        pairs = [(act, fused.silu_and_mul(gate_up))]
    else:
        pairs = []
        for tiles in (SkinnyTiles(16, 256, num_stages=4), SkinnyTiles(32, 256, num_stages=3)):
            act = skinny_linear(x, w, None, tiles, glu=True)
            pairs.append((act, fused.silu_and_mul(skinny_linear(x, w, None, tiles))))
    for act, expected in pairs:
        assert act.shape == (m, n2 // 2)
        torch.testing.assert_close(act.float(), expected.float(), rtol=1e-2, atol=1e-2)
