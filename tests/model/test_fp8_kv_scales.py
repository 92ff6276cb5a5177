"""Calibrated KV-cache scales (compressed-tensors' kv_cache_scheme, model/kv_scales.py) on CPU, fp32, llama and
qwen3 (whose k_norm takes k_scale): with the model's dtype in the cache they are not read; with an FP8 cache the
cache holds K / k_scale and V / v_scale rounded to FP8, and greedy stays logprob-close to the model-dtype cache.

The checkpoints make the scales matter: q_proj (Qwen3: q_norm) and o_proj are scaled by 1e4 and k_proj (k_norm) and
v_proj by 1e-4, which leaves the model's function as it was (the greedy tokens are checked equal) but puts K and V
near 5e-4, below E4M3's smallest subnormal step (2^-9): an FP8 cache without scales rounds them away. The scales are
calibrated as llm-compressor does, each layer's largest |K| and |V| over 448, from the model-dtype cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ostinato import LLM, SamplingParams
from ostinato.errors import CheckpointError
from ostinato.tools.checkpoint import make_checkpoint
from support.near_tie import identical_or_near_tie
from test_e2e_vs_hf import _prompts

pytest.importorskip("compressed_tensors")

FP8 = torch.float8_e4m3fn
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
PREFILL = SamplingParams(temperature=0.0, max_tokens=1)  # the prompt's K and V written, nothing decoded


def _llm(path: Path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64, **kwargs)


def _edited(src: Path, dst: Path, edit, kv_scheme: bool = False) -> Path:
    """A copy of checkpoint `src` whose tensors `edit` changed in place (and whose quantization_config gains
    the kv_cache_scheme)."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    if kv_scheme:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"]["kv_cache_scheme"] = KV_SCHEME
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _small_k_and_v(family: str, num_layers: int):
    q, k = ("q_norm.weight", "k_norm.weight") if family == "qwen3" else ("q_proj.weight_scale", "k_proj.weight_scale")

    def edit(tensors):
        for i in range(num_layers):
            for leaf, factor in ((q, 1e4), (k, 1e-4), ("v_proj.weight_scale", 1e-4), ("o_proj.weight_scale", 1e4)):
                name = f"model.layers.{i}.self_attn.{leaf}"
                tensors[name] = tensors[name] * factor
    return edit


def _with_scales(scales: list[tuple[float, float]]):
    def edit(tensors):
        for i, (k_scale, v_scale) in enumerate(scales):
            tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor([k_scale])
            tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([v_scale])
    return edit


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def checkpoints(request, tmp_path_factory):
    """(the checkpoint with small K and V, one with its calibrated scales, one with unit scales, the model-dtype
    cache's engine on the first, the prompts, the scales, that engine's cache after the prompts' prefill alone)."""
    family, tmp = request.param, tmp_path_factory.mktemp(f"kv-scales-{request.param}")
    src = make_checkpoint(tmp / "fp8", shape="tiny-128", family=family, seed=6, fp8_layout="compressed-tensors")
    config = json.loads((src / "config.json").read_text())
    layers = config["num_hidden_layers"]
    small = _edited(src, tmp / "small", _small_k_and_v(family, layers))
    prompts = _prompts(config["vocab_size"])[:4]
    auto = _llm(small)
    auto.generate(prompts, PREFILL)  # the prompts' K and V, in the slots a fresh FP8 engine writes them to
    prefilled = [(k.clone(), v.clone()) for k, v in auto.engine.runner.kv_caches]
    assert _tokens(_greedy(auto, prompts)) == _tokens(_greedy(_llm(src), prompts)), "the edit changed the model"
    # Calibrated as llm-compressor does (largest |K| over 448), then doubled layer by layer, so that a layer given
    # another's scale is seen: layer i's largest stored value is 448 / 2^i.
    scales = [(k.abs().max().item() / 448 * 2 ** i, v.abs().max().item() / 448 * 2 ** i)
              for i, (k, v) in enumerate(prefilled)]
    calibrated = _edited(small, tmp / "calibrated", _with_scales(scales), kv_scheme=True)
    unit = _edited(small, tmp / "unit", _with_scales([(1.0, 1.0)] * layers), kv_scheme=True)
    return small, calibrated, unit, auto, prompts, scales, prefilled


def _greedy(llm: LLM, prompts, params=GREEDY) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _tokens(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_a_cache_in_the_model_dtype_leaves_the_scales_unread(checkpoints):
    small, calibrated, _, _, prompts, _, _ = checkpoints
    assert _tokens(_greedy(_llm(calibrated), prompts)) == _tokens(_greedy(_llm(small), prompts))


def test_an_fp8_cache_holds_k_and_v_over_their_scales(checkpoints):
    """The first layer's K and V in the FP8 cache are torch's FP8 rounding of the model-dtype cache's over its
    scales (the scales are folded into the weights, whose fp32 rounding may move a value across a rounding
    boundary: then one FP8 step away, and rarely). Later layers' K and V differ by what FP8 attention did to their
    input; each layer's largest stored value is where its own scale puts it."""
    _, calibrated, _, _, prompts, scales, prefilled = checkpoints
    fp8 = _llm(calibrated, kv_cache_dtype="fp8")
    fp8.generate(prompts, PREFILL)
    caches = fp8.engine.runner.kv_caches
    for stored, values, scale in zip(caches[0], prefilled[0], scales[0]):
        want = (values / scale).to(FP8)
        assert stored.dtype == FP8
        assert (stored.view(torch.uint8) == want.view(torch.uint8)).float().mean() > 0.99
        torch.testing.assert_close(stored.float(), want.float(), rtol=2 ** -3, atol=2 ** -9)
    for i, layer in enumerate(caches):
        for stored in layer:
            assert stored.float().abs().max().item() == pytest.approx(448 / 2 ** i, rel=0.15)


def test_with_its_scales_an_fp8_cache_is_logprob_close_and_without_them_it_is_not(checkpoints):
    _, calibrated, unit, auto, prompts, _, _ = checkpoints
    want = _greedy(auto, prompts)
    got = _greedy(_llm(calibrated, kv_cache_dtype="fp8"), prompts)
    identical = sum(identical_or_near_tie(a, b) for a, b in zip(want, got))
    assert identical >= 1
    unscaled = _tokens(_greedy(_llm(unit, kv_cache_dtype="fp8"), prompts))
    assert all(u[0] != a.token_ids[0] for u, a in zip(unscaled, want)), "K and V survive FP8 unscaled: the test " \
                                                                          "no longer shows that the scales apply"


def test_a_missing_or_bad_scale_is_refused_by_name(checkpoints, tmp_path):
    calibrated = checkpoints[1]

    def drop(tensors):
        del tensors["model.layers.1.self_attn.v_scale"]

    def zero(tensors):
        tensors["model.layers.0.self_attn.k_scale"] = torch.tensor([0.0])

    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.v_scale is not stored"):
        _llm(_edited(calibrated, tmp_path / "missing", drop), kv_cache_dtype="fp8")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_scale is 0\.0: .* positive"):
        _llm(_edited(calibrated, tmp_path / "zero", zero), kv_cache_dtype="fp8")


@pytest.mark.parametrize("block", [None, (128, 128)], ids=["per-row", "block"])
def test_a_fold_scales_the_part_s_rows_alone(block):
    """k_scale / v_scale reach a fused projection's part through its FP8 scales, row or block ones (model/kv_scales.py
    `_scale_rows`): those rows' products change by the factor, the others' not at all."""
    from ostinato.kernels.fp8_linear import Fp8Linear
    from ostinato.model.kv_scales import _scale_rows

    gen = torch.Generator().manual_seed(0)
    module = Fp8Linear(256, 384, bias=True, block=block)
    module.weight.data = torch.randn(384, 256, generator=gen).to(FP8)
    module.weight_scale.data = torch.rand(module.weight_scale.shape, generator=gen) + 0.5
    module.bias.data = torch.randn(384, generator=gen)
    before_w, before_b = module.dequantize().clone(), module.bias.clone()
    _scale_rows(module, 128, 128, 0.25)
    after_w = module.dequantize()
    torch.testing.assert_close(after_w[128:256], before_w[128:256] * 0.25)
    torch.testing.assert_close(module.bias[128:256], before_b[128:256] * 0.25)
    assert torch.equal(after_w[:128], before_w[:128]) and torch.equal(after_w[256:], before_w[256:])
    assert torch.equal(module.bias[:128], before_b[:128]) and torch.equal(module.bias[256:], before_b[256:])
