"""FP8 checkpoints and --quantization fp8 (model/fp8_weights.py) on CPU, fp32: greedy tokens equal HF
transformers' on the same checkpoint dequantized (weight x scale), for each layout make-checkpoint writes, in
two families; transformers' own compressed-tensors loading too. Unsupported schemes are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ostinato import LLM, SamplingParams
from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import EngineArgs, ModelConfig
from ostinato.errors import CheckpointError, ConfigError
from ostinato.kernels.fp8_linear import FP8_DTYPE, Fp8Linear
from ostinato.model.loader import load_model, weights_nbytes
from ostinato.tools.checkpoint import make_checkpoint
from support.fp8 import dequantized_copy
from test_e2e_vs_hf import _hf_greedy, _prompts

pytest.importorskip("compressed_tensors")

MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _llm(path, **kwargs) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64, **kwargs)


def _greedy(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module", params=[("compressed-tensors", "llama"), ("compressed-tensors", "qwen3"),
                                        ("block", "llama"), ("block", "qwen3")], ids=lambda p: "-".join(p))
def fp8_checkpoint(request, tmp_path_factory):
    layout, family = request.param
    path = tmp_path_factory.mktemp(f"fp8-{layout}-{family}")
    make_checkpoint(path, shape="tiny-128", family=family, seed=5, fp8_layout=layout)
    return layout, path


def test_fp8_checkpoint_greedy_equals_hf_on_its_dequantized_copy(fp8_checkpoint, tmp_path):
    layout, path = fp8_checkpoint
    llm = _llm(path)
    prompts = _prompts(llm.engine.model_config.vocab_size)[:4]
    ours = _greedy(llm, prompts)
    assert ours == _hf_greedy(dequantized_copy(path, tmp_path / "dense"), prompts, MAX_TOKENS)
    assert len({tuple(o) for o in ours}) > 1, "degenerate checkpoint: every prompt gave the same tokens"


def test_transformers_reads_compressed_tensors_as_we_do(tmp_path):
    """transformers loads this layout itself (through compressed-tensors) and decompresses it to dense weights at
    its first forward: those equal ours, weight for weight. (Its forward then also rounds each input to FP8 per
    token, the scheme's W8A8, which ours does only at large batches, so its greedy tokens are no reference.)"""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint(tmp_path / "ct", shape="tiny-128", seed=5, fp8_layout="compressed-tensors")
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs(torch.tensor([[1]]))
    ours = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), TorchRefBackend(),
                      progress=False)
    hf_layer, layer = theirs.model.layers[1], ours.model.layers[1]
    qkv = layer.self_attn.qkv_proj.dequantize()
    gate_up = layer.mlp.gate_up_proj.dequantize()
    for hf, mine in [(hf_layer.self_attn.q_proj, qkv[:256]), (hf_layer.self_attn.k_proj, qkv[256:384]),
                     (hf_layer.self_attn.v_proj, qkv[384:]),
                     (hf_layer.self_attn.o_proj, layer.self_attn.o_proj.dequantize()),
                     (hf_layer.mlp.gate_proj, gate_up[:256]), (hf_layer.mlp.up_proj, gate_up[256:]),
                     (hf_layer.mlp.down_proj, layer.mlp.down_proj.dequantize())]:
        assert hf.weight.dtype == torch.float32 and torch.equal(hf.weight, mine)


def test_fp8_checkpoint_holds_one_byte_weights(fp8_checkpoint):
    layout, path = fp8_checkpoint
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), TorchRefBackend(),
                       progress=False)
    layer = model.model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(p, Fp8Linear) and p.weight.dtype == FP8_DTYPE for p in projections)
    assert (projections[0].block is None) == (layout == "compressed-tensors")
    assert model.model.embed_tokens.weight.dtype == model.lm_head.weight.dtype == torch.float32
    assert "fp8" in model.quantization_name


def test_quantization_fp8_quantizes_a_dense_checkpoint_per_channel(tmp_path):
    dense = make_checkpoint(tmp_path / "dense", shape="tiny-128", seed=5)
    stored = make_checkpoint(tmp_path / "ct", shape="tiny-128", seed=5, fp8_layout="compressed-tensors")
    llm = _llm(dense, quantization="fp8")
    prompts = _prompts(llm.engine.model_config.vocab_size)[:4]
    # The same per-channel E4M3 rounding as the stored compressed-tensors checkpoint of the same draws
    assert _greedy(llm, prompts) == _greedy(_llm(stored), prompts)
    config = ModelConfig.from_dir(dense)
    full = load_model(dense, config, torch.float32, torch.device("cpu"), TorchRefBackend(), progress=False)
    fp8 = load_model(dense, EngineArgs(str(dense), quantization="fp8").quantized(config), torch.float32,
                     torch.device("cpu"), TorchRefBackend(), progress=False)
    proj = full.model.layers[0].self_attn.qkv_proj.weight
    deq = fp8.model.layers[0].self_attn.qkv_proj.dequantize()
    assert 0 < (deq - proj).abs().max() <= proj.abs().amax() * 2 ** -4
    linear_params = sum(p.weight.numel() for p in fp8.modules() if isinstance(p, Fp8Linear))
    assert weights_nbytes(full) - weights_nbytes(fp8) == linear_params * 3 - 4 * sum(
        p.out_features for p in fp8.modules() if isinstance(p, Fp8Linear))  # 4 -> 1 byte, plus fp32 row scales


def _with_quantization_config(src: Path, dst: Path, qc: dict) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    return dst


W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128,
                                       "symmetric": True}}}}
STATIC = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}}


CHANNEL = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}}
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


@pytest.mark.parametrize("qc,words", [
    (W4A16, "int4 weights"),
    ({**CHANNEL, "kv_cache_scheme": {**KV_SCHEME, "type": "int"}}, "kv_cache_scheme int8"),
    ({**STATIC, "sparsity_config": {"format": "sparse-24-bitmask"}}, "sparse-24-bitmask"),
    (STATIC, "static input activation scales"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [64, 64]}, "[64, 64]"),
    ({"quant_method": "gptq", "bits": 4}, "'gptq'"),
], ids=["int4", "int8-kv-scales", "2:4-sparsity", "static-activations", "block-64", "gptq"])
def test_an_unsupported_scheme_is_refused_by_name(qc, words, tmp_path):
    src = make_checkpoint(tmp_path / "dense", shape="tiny", seed=1)
    path = _with_quantization_config(src, tmp_path / "q", qc)
    with pytest.raises(CheckpointError, match=words.replace("[", r"\[").replace("]", r"\]")):
        _llm(path)


def test_fp8_with_tensor_parallelism_is_refused(tmp_path):
    path = make_checkpoint(tmp_path / "dense", shape="tiny", seed=1)
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        EngineArgs(str(path), quantization="fp8", tensor_parallel_size=2).resolve(device="cpu")
    with pytest.raises(ConfigError, match="--quantization must be fp8"):
        EngineArgs(str(path), quantization="int4")


def test_per_tensor_scales_of_a_fused_qkv_stay_each_parts_own(tmp_path):
    """compressed-tensors' per-tensor strategy: one scale for each of q, k and v, different ones, so the fused
    qkv_proj holds them as rows. Greedy tokens equal HF's on the dequantized copy."""
    from safetensors.torch import load_file, save_file

    from ostinato.kernels.fp8_linear import FP8_MAX
    from ostinato.tools.checkpoint_fp8 import is_projection_weight

    dense = make_checkpoint(tmp_path / "dense", shape="tiny", seed=4)
    path = _with_quantization_config(dense, tmp_path / "pt", {**STATIC, "config_groups": {"group_0": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}})
    tensors = load_file(str(path / "model.safetensors"))
    for name in [n for n in tensors if is_projection_weight(n)]:
        w = tensors[name]
        scale = w.abs().amax() / FP8_MAX
        tensors[name] = (w / scale).to(FP8_DTYPE)
        tensors[name + "_scale"] = scale.reshape(1)
    save_file(tensors, str(path / "model.safetensors"))
    model = load_model(path, ModelConfig.from_dir(path), torch.float32, torch.device("cpu"), TorchRefBackend(),
                       progress=False)
    scales = model.model.layers[0].self_attn.qkv_proj.weight_scale  # q 64 rows, k 32, v 32
    parts = [scales[:64], scales[64:96], scales[96:]]
    assert all(torch.equal(p, p[:1].expand_as(p)) for p in parts) and len({p[0].item() for p in parts}) == 3
    llm = _llm(path)
    prompts = _prompts(llm.engine.model_config.vocab_size)[:4]
    assert _greedy(llm, prompts) == _hf_greedy(dequantized_copy(path, tmp_path / "ref"), prompts, MAX_TOKENS)
