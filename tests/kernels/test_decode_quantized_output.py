"""The decode attention writing its output quantized for a GGUF o_proj (kernels/decode_output.py): the same codes
and scales as the quantizing kernel makes from the output it would have stored (kernels/gguf_int8_dot.quantize_x),
split or not, through decode_with_rope as the decoder calls it.

On a CPU machine under the Triton interpreter; on CUDA too
(`PYTHONPATH=src python3 -m pytest -m gpu tests/kernels/test_decode_quantized_output.py`).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # tests/conftest.py does the same; kept so this file runs alone

pytest.importorskip("triton")

from ostinato.kernels.gguf_int8_dot import empty_quantized, quantize_x  # noqa: E402
from test_triton_attention import DEVICES, RopeCase, backend_with  # noqa: E402

FIELDS = ("xq", "dx", "sx", "cx", "s16")


def run_both(device, dtype, splits, group=4, head_dim=64, qk_norm=False):
    """(the output as the decode stores it, quantize_x of it, the output written quantized by the decode)."""
    case = RopeCase(device, dtype, [1, 16, 40, 90], group, 2, head_dim, qk_norm)
    backend = backend_with(splits=splits, block_n=16)
    caches = case.cache.k_cache.clone(), case.cache.v_cache.clone()
    out = case.run(backend)
    case.cache.k_cache.copy_(caches[0])
    case.cache.v_cache.copy_(caches[1])
    rows = out.shape[0]
    fused = empty_quantized(rows, case.num_heads * head_dim, torch.device(device))
    backend.decode_with_rope(case.heads, *case.weights, case.rope.cos_sin_cache, case.positions, 1e-6,
                             case.cache.k_cache, case.cache.v_cache, case.meta, case.scale, fused)
    return out, quantize_x(out.reshape(rows, -1)), fused


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("group,head_dim,qk_norm", [(4, 64, False), (2, 32, True), (1, 128, False)])
def test_quantized_output_is_what_quantize_x_makes_of_the_stored_output(device, splits, group, head_dim, qk_norm):
    """fp16, whose rounding the interpreter does as the GPU does: every code, scale and code sum identical; the sums
    of x (sx, and cx made from it) to float32 rounding, as the two kernels may add a block's 32 values in another
    order."""
    if device == "cpu" and head_dim == 128 and splits == 3:
        pytest.skip("covered by the other shapes; slow under the interpreter")
    out, want, fused = run_both(device, torch.float16, splits, group, head_dim, qk_norm)
    for name, a, b in zip(FIELDS, fused, want):
        exact = name in ("xq", "dx", "s16")
        torch.testing.assert_close(a.cpu(), b.cpu(), atol=0 if exact else 1e-5, rtol=0 if exact else 1e-5,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 3])
def test_bf16_quantized_output_dequantizes_to_the_output(device, splits):
    """bf16: the interpreter's stores truncate where the kernel rounds (kernels/rounding.round_like), so the
    codes are checked against the output itself: each within half a step (plus a bf16 rounding) of it."""
    out, _, fused = run_both(device, torch.bfloat16, splits)
    rows = out.shape[0]
    codes = fused.xq.cpu().view(torch.int8).reshape(rows, -1, 32).float()
    dx = fused.dx.cpu()[:, :, None]
    x = out.cpu().float().reshape(rows, -1, 32)
    assert (dx > 0).all()
    assert ((codes * dx - x).abs() <= dx * 0.5 + x.abs() * 2 ** -7 + 1e-6).all()
    torch.testing.assert_close(fused.sx.cpu(), x.sum(-1), atol=1e-2, rtol=1e-2)


def dequantized_linear(qx, layer):
    """layer(x) from x quantized (codes times each 32-block's scale): what a GGUF kernel's integer dot products
    compute, in float32, so that two paths giving the same codes give the same output."""
    rows = qx.xq.shape[0]
    x = (qx.xq.view(torch.int8).reshape(rows, -1, 32).float() * qx.dx[:, :, None]).reshape(rows, -1)
    return torch.nn.functional.linear(x, layer.weight.float()).to(layer.weight.dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_decoder_hands_o_projs_input_to_the_decode_and_back(device):
    """model/decoder.py's Attention at a decode step, with a kernel set whose o_proj reads x quantized (as a GGUF
    one does on CUDA, here a float32 reference of it): the decode (DecodeTuning.quantize_output, on by default)
    writes the quantized input and o_proj takes it, the same output as quantizing the stored output apart; with it
    off, o_proj gets the output as before."""
    import dataclasses

    from ostinato.config import ModelConfig
    from ostinato.kernels import fused
    from ostinato.model.decoder import DecoderLayer
    from ostinato.tools.checkpoint import hf_config_dict

    config = ModelConfig.from_hf_dict(hf_config_dict("tiny-256"))
    case = RopeCase(device, torch.float16, [5, 40], config.num_heads // config.num_kv_heads, config.num_kv_heads,
                    config.head_dim, False)
    attn = DecoderLayer(config, backend_with(block_n=16)).to(device, torch.float16).self_attn
    attn.k_cache, attn.v_cache = case.cache.k_cache, case.cache.v_cache
    seen = []

    def linear(x, layer, **_):  # the other path: the stored output quantized by a kernel of its own
        return dequantized_linear(quantize_x(x), layer) if layer is attn.o_proj else layer(x)

    def int8_input(x, layer, **_):
        seen.append(tuple(x.shape))
        return empty_quantized(x.shape[0], x.shape[1], x.device) if layer is attn.o_proj else None

    apart = dataclasses.replace(fused.TORCH_KERNELS, linear=linear, qk_norm_rope_write_kv=fused.qk_norm_rope_write_kv)
    handed = dataclasses.replace(apart, int8_input=int8_input,
                                 int8_input_linear=lambda qx, x, layer, **_: dequantized_linear(qx, layer))
    caches = case.cache.k_cache.clone(), case.cache.v_cache.clone()
    outs = []
    for kernels in (apart, handed):
        case.cache.k_cache.copy_(caches[0])
        case.cache.v_cache.copy_(caches[1])
        qkv = case.heads.reshape(case.heads.shape[0], -1)
        outs.append(attn(qkv, case.positions, case.rope.cos_sin_cache, case.meta, kernels))
    assert seen == [(case.heads.shape[0], config.num_heads * config.head_dim)]
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    attn.backend = backend_with(block_n=16, quantize_output=False)  # o_proj's input is not asked for
    case.cache.k_cache.copy_(caches[0])
    case.cache.v_cache.copy_(caches[1])
    again = attn(case.heads.reshape(case.heads.shape[0], -1), case.positions, case.rope.cos_sin_cache, case.meta,
                 handed)
    assert len(seen) == 1
    torch.testing.assert_close(again, outs[0], atol=0, rtol=0)
