"""The safetensors loader: sharded checkpoints, dtype choice, fused-parameter filling, and every way a
checkpoint folder can be broken (each must raise CheckpointError naming what is wrong)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

import ostinato
from ostinato.attention.base import AttentionMetadata
from ostinato.attention.torch_ref import TorchRefBackend
from ostinato.config import ModelConfig
from ostinato.errors import CheckpointError, ConfigError
from ostinato.model.decoder import fused_shards
from ostinato.model.loader import load_model, resolve_dtype, weights_nbytes

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=300, max_position_embeddings=128, initializer_range=0.1)
CPU = torch.device("cpu")


def save_tiny(path, config_cls=Qwen3Config, max_shard_size=None, **overrides):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_cls(**TINY, **overrides))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(path, **kwargs)
    return hf


def load(path, dtype=torch.float32):
    return load_model(path, ModelConfig.from_dir(path), dtype, CPU, TorchRefBackend(), progress=False)


@torch.no_grad()
def prefill_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """One sequence prefilled into block 0 of a one-block cache -> logits [len, vocab]."""
    cfg, n = model.config, len(tokens)
    dtype = model.lm_head.weight.dtype
    shape = (2, 16, cfg.num_kv_heads, cfg.head_dim)  # block 0 for the sequence, block 1 the scratch block
    model.bind_kv_caches([(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
                          for _ in range(cfg.num_layers)])
    meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.arange(n),
                             block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             context_lens=torch.tensor([n], dtype=torch.int32),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             query_lens=[n], context_lens_host=[n], max_query_len=n, max_context_len=n)
    return model.compute_logits(model(tokens, torch.arange(n), meta))


def assert_weights_match(ours, hf, dtype=torch.float32):
    """Every HF tensor sits, exactly (after the dtype cast), where the loader should have put it."""
    shards = fused_shards(ours.config)
    params = dict(ours.named_parameters())
    for name, tensor in hf.state_dict().items():
        module_path, _, leaf = name.rpartition(".")
        parent, _, proj = module_path.rpartition(".")
        if proj in shards:
            fused, start, rows = shards[proj]
            mine = params[f"{parent}.{fused}.{leaf}"][start:start + rows]
        elif name == "lm_head.weight" and ours.tied:
            mine = params["model.embed_tokens.weight"]
        else:
            mine = params[name]
        assert mine.dtype == dtype
        assert torch.equal(mine, tensor.to(dtype)), name


def test_sharded_checkpoint_loads_every_tensor(tmp_path):
    hf = save_tiny(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    ours = load(tmp_path)
    assert_weights_match(ours, hf)
    assert weights_nbytes(ours) == sum(p.numel() * 4 for p in hf.parameters())


def test_bf16_load_casts_weights_and_rope_table(tmp_path):
    hf = save_tiny(tmp_path)
    ours = load(tmp_path, torch.bfloat16)
    assert_weights_match(ours, hf, torch.bfloat16)
    assert ours.model.rotary_emb.cos_sin_cache.dtype == torch.bfloat16
    assert weights_nbytes(ours) == sum(p.numel() * 2 for p in hf.parameters())
    # And it runs: logits close to HF's own bf16 forward (bf16 rounding differs slightly by op order).
    tokens = torch.arange(3, 40, 3)
    with torch.no_grad():
        expected = hf.to(torch.bfloat16)(tokens[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(ours, tokens), expected, atol=0.1, rtol=0)


def test_tied_embeddings_are_one_tensor(tmp_path):
    hf = save_tiny(tmp_path, LlamaConfig, tie_word_embeddings=True)
    ours = load(tmp_path)
    assert ours.tied and ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    assert_weights_match(ours, hf)
    assert weights_nbytes(ours) == sum(p.numel() * 4 for p in hf.parameters())  # counted once


def test_checkpoint_without_lm_head_ties_even_if_config_does_not(tmp_path):
    save_tiny(tmp_path, LlamaConfig)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load(tmp_path)
    assert ours.tied and torch.equal(ours.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_old_rotary_inv_freq_tensors_are_ignored(tmp_path):
    hf = save_tiny(tmp_path, LlamaConfig)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)  # a wrong table, if it were used
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = load(tmp_path)
    assert_weights_match(ours, hf)
    # The rotary table is computed from config.json, not read from the stale tensor: HF's own forward agrees.
    tokens = torch.arange(5, 60, 5)
    with torch.no_grad():
        expected = hf(tokens[None]).logits[0]
    torch.testing.assert_close(prefill_logits(ours, tokens), expected, atol=1e-4, rtol=1e-4)


def test_folder_without_weights_names_the_file_it_looked_for(tmp_path):
    save_tiny(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        load(tmp_path)


def test_index_naming_a_missing_shard_names_that_shard(tmp_path):
    save_tiny(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / victim).unlink()
    with pytest.raises(CheckpointError, match=victim.replace(".", r"\.")):
        load(tmp_path)


def test_missing_tensor_is_named(tmp_path):
    save_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]  # one shard of a fused parameter
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load(tmp_path)


def test_tensor_with_no_place_in_the_model_is_named(tmp_path):
    save_tiny(tmp_path, LlamaConfig)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.bias"] = torch.zeros(64)  # Llama mlp_bias: not implemented
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.down_proj\.bias"):
        load(tmp_path)


def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    save_tiny(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(100, 64)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"up_proj\.weight has shape \(100, 64\).*\(128, 64\)"):
        load(tmp_path)


def test_unsupported_architecture(tmp_path):
    save_tiny(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        ModelConfig.from_dir(tmp_path)


def test_resolve_dtype():
    bf16_ckpt = ModelConfig.from_hf_dict({**Qwen3Config(**TINY).to_dict(), "dtype": "bfloat16",
                                          "architectures": ["Qwen3ForCausalLM"]})
    cuda = torch.device("cuda")  # only the device type matters; no GPU needed
    assert resolve_dtype("auto", bf16_ckpt, CPU) == torch.float32
    assert resolve_dtype("auto", bf16_ckpt, cuda) == torch.bfloat16
    assert resolve_dtype("bf16", bf16_ckpt, CPU) == torch.bfloat16
    assert resolve_dtype("fp16", bf16_ckpt, cuda) == torch.float16
    assert resolve_dtype("float32", bf16_ckpt, cuda) == torch.float32
    with pytest.raises(ConfigError, match="--dtype"):
        resolve_dtype("int8", bf16_ckpt, cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_loads_straight_to_gpu(tmp_path):
    hf = save_tiny(tmp_path, max_shard_size="40KB")
    ours = load_model(tmp_path, ModelConfig.from_dir(tmp_path), torch.bfloat16, torch.device("cuda"),
                      TorchRefBackend(), progress=False)
    assert all(p.device.type == "cuda" for p in ours.parameters())
    assert ours.model.rotary_emb.cos_sin_cache.device.type == "cuda"
    assert_weights_match(ours.cpu(), hf, torch.bfloat16)


def test_building_the_model_to_load_it_does_not_import_torch_dynamo(tmp_path):
    """The loaders build the decoder on the meta device. An op there that goes through torch._refs (nn.Embedding's
    normal_, the RoPE table) imports torch._dynamo on its first call, seconds of every start-up for nothing: the
    weights and the table are filled on the real device. Run in a fresh interpreter, as this one may have it."""
    path = tmp_path / "ckpt"
    save_tiny(path)
    code = (f"import sys, torch\n"
            f"from ostinato.attention.torch_ref import TorchRefBackend\n"
            f"from ostinato.config import ModelConfig\n"
            f"from ostinato.model.decoder import DecoderForCausalLM\n"
            f"with torch.device('meta'):\n"
            f"    DecoderForCausalLM(ModelConfig.from_dir({str(path)!r}), TorchRefBackend())\n"
            f"print('torch._dynamo' in sys.modules)\n")
    src = str(Path(ostinato.__file__).parents[1])  # this ostinato, whichever checkout the interpreter would find
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "False"
