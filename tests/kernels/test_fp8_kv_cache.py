"""--kv-cache-dtype fp8: K and V stored as E4M3, attention computed in the activations' dtype, or in fp16 where the
Triton kernels' loops multiply 16-bit activations over an FP8 cache.

What must hold, kernel by kernel: a write stores exactly torch's rounding of K and V to E4M3 (values beyond 448
saturated, never NaN); attention over an FP8 cache gives the bits it gives over a cache of the model's dtype holding
the same values (E4M3 widens exactly to bf16 and fp32), but for that fp16 loop (decode and prefill), which must be
close to the float64 reference and saturate a q beyond fp16's range. The fused decode (q/k norm, RoPE and the K/V
write in the attention kernel) must attend to the newest token as the cache holds it, as every later step will:
checked in fp32, where the difference is far above the tolerance. CPU: the Triton interpreter (tests/conftest.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from ostinato.attention.torch_ref import TorchRefBackend  # noqa: E402
from ostinato.attention.triton_paged import TritonPagedBackend, batch_invariant_tuning  # noqa: E402
from ostinato.kernels import fused  # noqa: E402
from test_triton_attention import (DEVICES, PagedCache, RopeCase, assert_close_to_reference, backend_with,  # noqa: E402
                                   decode_meta, prefill_meta, reference_attention)

FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


def _assert_rounds_to_fp8(stored: torch.Tensor, values: torch.Tensor) -> None:
    """stored (FP8) is torch's rounding of values clamped to 448: to nearest even, beyond 448 saturated. (The clamp
    is the reference's own: torch's conversion saturates in some versions and makes NaN past 464 in others.)"""
    assert torch.equal(_bits(stored), _bits(values.cpu().float().clamp(-448, 448).to(FP8)))


def _assert_fp8_of(cache: torch.Tensor, expected: torch.Tensor) -> None:
    """cache holds expected rounded to FP8, but where the kernel's fp32 norm and RoPE (summed in another order than
    torch's) put a value across a rounding boundary: then one FP8 step away, and rarely."""
    want = expected.to(FP8)
    same = _bits(cache) == _bits(want)
    assert same.float().mean() > 0.999
    torch.testing.assert_close(cache.cpu().float(), want.cpu().float(), rtol=2 ** -3, atol=2 ** -9)


def _as_fp8(cache: PagedCache) -> PagedCache:
    """The same pool with its caches stored as FP8, and `cache` itself holding the values FP8 rounds them to."""
    fp8 = PagedCache.__new__(PagedCache)
    fp8.__dict__.update(cache.__dict__)
    fp8.k_cache, fp8.v_cache = cache.k_cache.to(FP8), cache.v_cache.to(FP8)
    cache.k_cache, cache.v_cache = fp8.k_cache.to(cache.k_cache.dtype), fp8.v_cache.to(cache.v_cache.dtype)
    return fp8


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", [TritonPagedBackend, TorchRefBackend])
def test_a_write_stores_torch_s_fp8_rounding_saturated(device, dtype, backend):
    num_blocks, block_size, num_kv_heads, head_dim, num_tokens = 5, 4, 2, 32, 7
    gen = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 300).to(dtype)  # some beyond 448
    v = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen) * 300).to(dtype)
    assert (k.abs() > 448).any()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.zeros(shape, dtype=FP8, device=device) for _ in range(2))
    backend().write_kv(k.to(device), v.to(device), k_cache, v_cache, slots.to(device))
    for cache, new in ((k_cache, k), (v_cache, v)):
        written = cache.cpu().flatten(0, 1)[slots]
        _assert_rounds_to_fp8(written, new)
        assert written.float().abs().max() == 448  # saturated, not NaN


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 5])
def test_decode_over_fp8_attends_to_the_widened_values(device, dtype, splits):
    """fp32 activations read the cache widened to fp32: the bits of decode over a cache holding those values. 16-bit
    ones multiply in fp16 (attention_common.to_loop_type says why), not in bf16 as over a bf16 cache: close to the
    float64 reference."""
    backend = backend_with(splits=splits, block_n=16)
    cache = PagedCache([1, 15, 17, 100], 2, 64, 16, dtype, device, seed=4, filler=0.0)
    fp8 = _as_fp8(cache)
    q = torch.randn(4, 4, 64, generator=torch.Generator().manual_seed(5)).to(device, dtype)
    meta = decode_meta(cache)
    out = backend.decode(q, fp8.k_cache, fp8.v_cache, meta, 0.125)
    if dtype == torch.float32:
        assert torch.equal(out, backend.decode(q, cache.k_cache, cache.v_cache, meta, 0.125))
    assert_close_to_reference(out, reference_attention(q, cache, [1] * 4, 0.125), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_query_beyond_fp16_s_range_saturates_over_an_fp8_cache(device):
    """The loops multiply in fp16, whose largest value is 65504; a bf16 q past it saturates there rather than
    become inf and make the scores NaN: decode and prefill."""
    cache = PagedCache([3, 40], 2, 32, 16, torch.bfloat16, device, seed=9, filler=0.0)
    fp8 = _as_fp8(cache)
    q = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    q[:, :, 0] = 1e6
    out = backend_with(splits=2, block_n=16).decode(q.to(device), fp8.k_cache, fp8.v_cache, decode_meta(cache), 0.2)
    assert_close_to_reference(out, reference_attention(q.clamp(-65504, 65504), cache, [1] * 2, 0.2), torch.bfloat16)
    query_lens = [3, 9]  # the prefill kernels' loops too
    out = TritonPagedBackend().prefill(q.repeat(6, 1, 1)[:12].to(device), fp8.k_cache, fp8.v_cache,
                                       prefill_meta(cache, query_lens), 0.2)
    assert_close_to_reference(out, reference_attention(q.repeat(6, 1, 1)[:12].clamp(-65504, 65504), cache,
                                                       query_lens, 0.2), torch.bfloat16)


# The default prefill (split over the context where a sequence is long) and the one-pass kernel.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", [TritonPagedBackend(), TritonPagedBackend(batch_invariant_tuning(
    TritonPagedBackend().tuning)), TorchRefBackend()], ids=["triton", "triton-one-pass", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_over_fp8_attends_to_the_widened_values(device, backend, dtype):
    """As decode: the bits of prefill over the widened values where the loop keeps q's type (fp32 activations, the
    torch backend), close to the float64 reference where the Triton kernels multiply 16-bit ones in fp16."""
    query_lens, prefixes = [1, 7, 70, 20], [5, 16, 0, 31]
    cache = PagedCache([p + q for p, q in zip(prefixes, query_lens)], 2, 32, 16, dtype, device, seed=6, filler=0.0)
    fp8 = _as_fp8(cache)
    q = torch.randn(sum(query_lens), 4, 32, generator=torch.Generator().manual_seed(7)).to(device, dtype)
    meta = prefill_meta(cache, query_lens)
    out = backend.prefill(q, fp8.k_cache, fp8.v_cache, meta, 0.2)
    if dtype == torch.float32 or isinstance(backend, TorchRefBackend):
        assert torch.equal(out, backend.prefill(q, cache.k_cache, cache.v_cache, meta, 0.2))
    assert_close_to_reference(out, reference_attention(q, cache, query_lens, 0.2), dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk-norm", "rope-only"])
def test_fused_decode_attends_to_the_newest_token_as_the_fp8_cache_holds_it(device, qk_norm):
    case = RopeCase(device, torch.float32, [1, 16, 17, 40], 2, 2, 32, qk_norm, seed=3, filler=0.0)
    case.cache = _as_fp8(case.cache)
    _, (k_expected, v_expected) = case.expected((case.cache.k_cache.float(), case.cache.v_cache.float()))
    out = case.run(backend_with(splits=3, block_n=16))
    _assert_fp8_of(case.cache.k_cache, k_expected)
    _assert_rounds_to_fp8(case.cache.v_cache, v_expected)  # v is copied, not computed
    widened = PagedCache.__new__(PagedCache)
    widened.__dict__.update(case.cache.__dict__)
    widened.k_cache, widened.v_cache = case.cache.k_cache.float(), case.cache.v_cache.float()
    h = case.num_heads
    q = fused.qk_norm_rope_ref(case.heads, *case.weights, case.rope.cos_sin_cache, case.positions, h,
                               case.num_kv_heads, 1e-6)[:, :h]
    assert_close_to_reference(out, reference_attention(q, widened, [1] * len(case.positions), case.scale),
                              torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_the_fused_qk_norm_rope_write_stores_fp8(device):
    case = RopeCase(device, torch.bfloat16, [3, 20], 2, 2, 32, True, seed=8, filler=0.0)
    k_cache, v_cache = (c.to(FP8) for c in (case.cache.k_cache, case.cache.v_cache))
    _, (k_expected, v_expected) = case.expected((k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16)))
    fused.qk_norm_rope_write_kv(case.heads, *case.weights, case.rope.cos_sin_cache, case.positions, case.num_heads,
                                case.num_kv_heads, 1e-6, k_cache, v_cache, case.meta.slot_mapping)
    _assert_fp8_of(k_cache, k_expected)
    _assert_rounds_to_fp8(v_cache, v_expected)
