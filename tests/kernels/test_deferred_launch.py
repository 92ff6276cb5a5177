"""kernels/deferred_launch.py: inside a compile-ahead pass, the GEMV and the few-rows linear hand their launch over
(the kernel and its exact arguments) and zero what they would have written, touching nothing else; outside one they
compute as ever. (The decode attention's: tests/kernels/test_triton_attention.py; the sampling kernels':
tests/kernels/test_sampling_kernel.py.)"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.kernels import deferred_launch, fused, gemv, skinny  # noqa: E402
from ostinato.kernels.deferred_launch import compiling_instead  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Sink:
    def __init__(self):
        self.launches = []

    def __call__(self, kernel, grid, args, kwargs):
        self.launches.append((kernel, grid, args, kwargs))


def handed(t: torch.Tensor) -> deferred_launch.PointerArg:
    """What the sink gets for a tensor argument."""
    return deferred_launch.PointerArg(t.dtype, t.data_ptr())


def _rows(m, k, seed):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def test_outside_a_pass_the_kernel_runs_and_inside_it_goes_to_the_sink():
    ran = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: ran.append((grid, args, kwargs))

    out = torch.ones(3)
    deferred_launch.launch(Kernel(), (2,), (out, 7), {"BLOCK": 4}, (out,))
    assert ran == [((2,), (out, 7), {"BLOCK": 4})] and out.eq(1).all()
    sink = Sink()
    with compiling_instead(sink):
        deferred_launch.launch(Kernel(), (2,), (out, 7), {"BLOCK": 4}, (out,))
    assert len(ran) == 1 and len(sink.launches) == 1 and not out.any()
    deferred_launch.launch(Kernel(), (2,), (out, 7), {"BLOCK": 4}, (out,))  # the pass's sink is gone again
    assert len(ran) == 2 and len(sink.launches) == 1


def test_the_sink_gets_no_tensor_but_what_triton_specialises_on():
    """A launch waiting for its compile must hold no device memory (start-up profiles memory meanwhile): the sink
    gets each tensor as its dtype and address, which Triton specialises on as it does on the tensor."""
    import weakref

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    rows = torch.zeros(64, dtype=torch.bfloat16, device=DEVICE)
    sink, alive = Sink(), []
    with compiling_instead(sink):
        for x in (rows, rows[1:], rows.float(), rows[8:].to(torch.int32)):
            alive.append(weakref.ref(x))
            deferred_launch.launch(object(), (1,), (x, 3), {"BLOCK": 4, "w": x}, ())
            passed = sink.launches[-1][2][0]
            assert passed == handed(x) and sink.launches[-1][3] == {"BLOCK": 4, "w": handed(x)}
            for align in (True, False):
                assert native_specialize_impl(BaseBackend, passed, False, True, align) == \
                    native_specialize_impl(BaseBackend, x, False, True, align)
            del x
    del rows
    assert not any(ref() for ref in alive)  # the sink's launches keep none of them alive


@pytest.mark.parametrize("with_residual", [True, False])
def test_the_norm_folded_gemv_zeroes_its_outputs_and_leaves_its_inputs(with_residual):
    x, residual, w = _rows(1, 64, 1), _rows(1, 64, 2) if with_residual else None, _rows(24, 64, 3)
    norm_weight = torch.ones(64, device=DEVICE)
    x_before = x.clone()
    sink = Sink()
    with compiling_instead(sink):
        out, residual_out = gemv.gemv_norm_linear(x, residual, norm_weight, 1e-6, w, None, gemv.GemvTiles(4, 32))
    (kernel, grid, args, kwargs), = sink.launches
    assert kernel is gemv._gemv_kernel and grid == (6,) and kwargs["HAS_RESIDUAL"] is with_residual
    assert args[0] == handed(x) and args[1] == handed(w) and args[3] == handed(out)
    assert not out.any() and torch.equal(x, x_before)
    assert (not residual_out.any()) if with_residual else residual_out is x
    real, _ = gemv.gemv_norm_linear(x, residual, norm_weight, 1e-6, w, None, gemv.GemvTiles(4, 32))
    assert real.abs().sum() > 0


def test_the_few_rows_linear_hands_its_launch_over():
    x, w = _rows(5, 32, 4), _rows(40, 32, 5)
    tiles = skinny.SkinnyTiles(32, 32)
    sink = Sink()
    with compiling_instead(sink):
        out = skinny.skinny_linear(x, w, None, tiles)
    (kernel, _, args, kwargs), = sink.launches
    assert kernel is skinny._skinny_kernel and args[3] == handed(out) and kwargs["M_PAD"] == 16 and not out.any()
    torch.testing.assert_close(skinny.skinny_linear(x, w, None, tiles), x @ w.T, rtol=1e-4, atol=1e-3)


def test_the_norm_and_the_activation_hand_their_launches_over():
    x, residual, weight = _rows(3, 64, 6), _rows(3, 64, 7), torch.ones(64, device=DEVICE)
    x_before, residual_before = x.clone(), residual.clone()
    sink = Sink()
    with compiling_instead(sink):
        normed, summed = fused.fused_add_rms_norm(x, residual, weight, 1e-6)
        activated = fused.silu_and_mul(x)
    assert [kernel for kernel, *_ in sink.launches] == [fused._rms_norm_kernel, fused._silu_and_mul_kernel]
    assert not normed.any() and not summed.any() and not activated.any()
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_the_rotary_embedding_hands_its_launch_over_and_leaves_the_cache():
    tokens, heads, kv_heads, dim = 2, 4, 2, 16
    qkv = _rows(tokens, (heads + 2 * kv_heads) * dim, 8).view(tokens, heads + 2 * kv_heads, dim)
    cos_sin = _rows(32, 2 * dim, 9)
    k_cache = torch.full((2, 16, kv_heads, dim), 7.0, device=DEVICE)
    v_cache = k_cache.clone()
    sink = Sink()
    with compiling_instead(sink):
        q = fused.qk_norm_rope_write_kv(qkv, None, None, cos_sin, torch.tensor([3, 5], device=DEVICE), heads,
                                        kv_heads, 1e-6, k_cache, v_cache, torch.tensor([0, 17], device=DEVICE))
    assert [kernel for kernel, *_ in sink.launches] == [fused._qk_norm_rope_kernel]
    assert q.shape == (tokens, heads, dim) and not q.any() and k_cache.eq(7).all() and v_cache.eq(7).all()
