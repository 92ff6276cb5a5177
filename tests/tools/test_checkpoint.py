"""`ostinato make-checkpoint`: the folders it writes load in transformers and behave like real models."""

import argparse
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from ostinato.config import ModelConfig
from ostinato.errors import ConfigError
from ostinato.tools import checkpoint as ck
from ostinato.tools import checkpoint_weights

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
PROMPTS = ["Once upon a time", "What is the capital of France?", "Good software is tested with care."]
TEXT = 'The weather today is sunny, and 42 people (of the town) walk by the "river"; café, naïve.\nBye!'


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """One tiny checkpoint per family, written once for the module."""
    return {f: ck.make_checkpoint(tmp_path_factory.mktemp(f"tiny-{f}"), "tiny", f) for f in FAMILIES}


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _all_files(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_loads_in_transformers_and_generates_varied_tokens(tiny_dirs, family):
    path = tiny_dirs[family]
    tokenizer = AutoTokenizer.from_pretrained(path)
    model, info = _load(path)
    # Every HF parameter came from the file (q/k/v biases for qwen2, q/k norms for qwen3) and nothing was left.
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(model).__name__ == ck.FAMILIES[family]
    assert len(tokenizer) == model.config.vocab_size == ck.TINY_VOCAB_SIZE

    ids = tokenizer(TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits  # [1, seq, vocab]
    assert logits.shape == (1, ids.shape[1], ck.TINY_VOCAB_SIZE) and torch.isfinite(logits).all()
    # Peaked logits: fp32 implementations differ by ~1e-5, so greedy comparisons need clear winners.
    top2 = logits[0].topk(2).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.2 and gaps.min() > 1e-4 and logits.std() > 2.0

    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
        new = out[0, inputs.input_ids.shape[1]:].tolist()
        assert len(new) == 16 and len(set(new)) >= 8, new


@pytest.mark.parametrize("family", FAMILIES)
def test_config_round_trips_through_transformers_and_ostinato(tiny_dirs, family):
    path = tiny_dirs[family]
    hf = AutoConfig.from_pretrained(path)
    spec = ck.SHAPES["tiny"]
    assert hf.architectures == [ck.FAMILIES[family]]
    assert (hf.hidden_size, hf.num_hidden_layers) == (64, 2)
    assert (hf.num_attention_heads, hf.num_key_value_heads) == (4, 2)
    assert (hf.head_dim, hf.intermediate_size, hf.vocab_size) == (16, 128, ck.TINY_VOCAB_SIZE)
    assert hf.max_position_embeddings == 2048 and hf.tie_word_embeddings is False
    assert hf.rope_parameters["rope_theta"] == spec.rope_theta
    assert hf.bos_token_id == 0 and list(hf.eos_token_id) == [1, 3]
    assert GenerationConfig.from_pretrained(path).eos_token_id == [1, 3]

    ours = ModelConfig.from_dir(path)
    assert ours.family == family and ours.vocab_size == ck.TINY_VOCAB_SIZE and ours.head_dim == 16
    assert ours.attention_bias == (family == "qwen2") and ours.qk_norm == (family == "qwen3")
    assert ours.max_position_embeddings == 2048 and ours.rope_theta == spec.rope_theta
    assert ours.eos_token_ids == (1, 3) and ours.checkpoint_dtype == "float32" and ours.rope_scaling is None

    names = set(load_file(path / "model.safetensors"))
    assert names == set(ck.weight_shapes(json.loads((path / "config.json").read_text())))
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert ("model.layers.1.self_attn.k_norm.weight" in names) == (family == "qwen3")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tokenizer_round_trips_and_applies_chat_template(tiny_dirs, family):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dirs[family])
    ids = tokenizer(TEXT).input_ids
    # Llama-style tokenizers prepend <|begin_of_text|>, Qwen-style do not.
    assert (ids[0] == 0) == (family == "llama")
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT
    assert len(ids) < 0.6 * len(TEXT)  # trained merges, not bytes
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    bos = "<|begin_of_text|>" if family == "llama" else ""
    assert text == (bos + "<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nWhat is the capital?<|im_end|>\n<|im_start|>assistant\n")
    chat_ids = tokenizer(text, add_special_tokens=False).input_ids
    assert chat_ids.count(2) == 3 and chat_ids.count(3) == 2  # <|im_start|> and <|im_end|> stay whole
    assert tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 1


def test_tied_shape_has_no_lm_head_and_ties_in_transformers(tmp_path):
    path = ck.make_checkpoint(tmp_path, "tiny-tied")
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model, info = _load(path)
    assert not info["missing_keys"]
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert ModelConfig.from_dir(path).tie_word_embeddings


def test_rope_scaled_shape_reads_as_llama3_everywhere(tmp_path):
    path = ck.make_checkpoint(tmp_path, "tiny-rope-scaled")
    params = AutoConfig.from_pretrained(path).rope_parameters
    assert params["rope_type"] == "llama3" and params["factor"] == 4.0
    assert params["original_max_position_embeddings"] == 256
    assert ModelConfig.from_dir(path).rope_scaling["rope_type"] == "llama3"
    model, _ = _load(path)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(300)[None] % ck.TINY_VOCAB_SIZE).logits).all()


def test_sharded_layout_has_index_loads_and_matches_single_file(tmp_path, tiny_dirs):
    path = ck.make_checkpoint(tmp_path, "tiny", "qwen2", max_shard_size=150_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (path / "model.safetensors").exists()
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(load_file(tiny_dirs["qwen2"] / "model.safetensors"))
    sharded, info = _load(path)
    assert not info["missing_keys"]
    single, _ = _load(tiny_dirs["qwen2"])
    # Each tensor is seeded by its name: the layout does not change the weights.
    ids = torch.tensor([[5, 100, 200, 300]])
    with torch.no_grad():
        assert torch.equal(sharded(ids).logits, single(ids).logits)

    # Rewriting the folder unsharded removes the stale shards and index.
    ck.make_checkpoint(path, "tiny", "qwen2")
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = ck.make_checkpoint(tmp_path / "a", "tiny", "qwen3", seed=7, dtype="bfloat16")
    b = ck.make_checkpoint(tmp_path / "b", "tiny", "qwen3", seed=7, dtype="bfloat16")
    c = ck.make_checkpoint(tmp_path / "c", "tiny", "qwen3", seed=8, dtype="bfloat16")
    assert _all_files(a) == _all_files(b)
    wa, wc = load_file(a / "model.safetensors"), load_file(c / "model.safetensors")
    assert wa["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])
    norm = wa["model.layers.0.input_layernorm.weight"].float()
    assert 0.5 <= norm.min() and norm.max() <= 1.5 and norm.std() > 0.1
    # Tests build many of these: what keeps one cheap is its size (a wall-clock bound would fail on a busy
    # machine, and pass on a fast one whatever the size).
    assert sum(f.stat().st_size for f in a.iterdir()) < 512 * 1024


def test_chunked_threaded_draws_match_serial_and_fill_every_element(tmp_path, monkeypatch):
    # Public shapes draw big tensors in chunks on a thread pool; shrink both thresholds to run that path.
    monkeypatch.setattr(checkpoint_weights, "_CHUNK_NUMEL", 1000)
    serial = ck.make_checkpoint(tmp_path / "serial", "tiny", "qwen3")
    monkeypatch.setattr(checkpoint_weights, "_POOL_MIN_BYTES", 0)
    threaded = ck.make_checkpoint(tmp_path / "threaded", "tiny", "qwen3")
    assert _all_files(serial) == _all_files(threaded)
    weights = load_file(threaded / "model.safetensors")
    embed = weights["model.embed_tokens.weight"].flatten()  # 32768 elements: 33 chunks, the last one partial
    chunks = embed[:32000].view(32, 1000)
    assert (chunks.std(dim=1) - 0.2).abs().max() < 0.03 and embed[32000:].std() > 0.15  # no element left as is
    assert not torch.equal(chunks[0], chunks[1])  # each chunk has its own generator
    final_norm = weights["model.norm.weight"]
    assert 1.0 <= final_norm.min() and final_norm.max() <= 3.0  # [0.5, 1.5] x final_norm_gain 2


@pytest.mark.parametrize(("shape", "family", "params"), [
    ("qwen3-0.6b", "qwen3", 0.596e9), ("llama-3.2-1b", "llama", 1.236e9), ("llama-3.1-8b", "llama", 8.030e9),
    ("llama-3.1-70b", "llama", 70.554e9),
])
def test_public_shapes_have_real_dimensions(shape, family, params):
    assert ck.parameter_count(shape) == pytest.approx(params, rel=0.002)
    config = ck.hf_config_dict(shape, dtype="bfloat16")
    assert config["architectures"] == [ck.FAMILIES[family]] and config["torch_dtype"] == "bfloat16"
    ours = ModelConfig.from_hf_dict(config)
    if shape.startswith("llama"):
        assert ours.rope_theta == 500000.0 and ours.max_position_embeddings == 131072
        assert ours.rope_scaling["factor"] == (32.0 if shape == "llama-3.2-1b" else 8.0)
        assert ours.rope_scaling["original_max_position_embeddings"] == 8192
        assert ours.tie_word_embeddings == (shape == "llama-3.2-1b")
        assert (ours.vocab_size, ours.num_kv_heads) == (128256, 8)
    else:
        assert (ours.hidden_size, ours.num_layers, ours.head_dim, ours.vocab_size) == (1024, 28, 128, 151936)
        assert ours.qk_norm and ours.tie_word_embeddings and ours.rope_theta == 1e6 and ours.rms_norm_eps == 1e-6
        assert ours.max_position_embeddings == 40960


def test_big_vocab_tokenizer_decodes_every_model_id(tmp_path):
    # Random models at public shapes emit ids far beyond the trained BPE; each must decode to text.
    ck.write_tokenizer(tmp_path, vocab_size=128256, family="llama", model_max_length=131072)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 128256
    for token_id in (600, 5000, 128255):
        assert tokenizer.decode([token_id]).strip().isalpha()
    assert all(t is not None for t in tokenizer.convert_ids_to_tokens([511, 512, 128255]))
    ids = tokenizer(TEXT).input_ids
    assert max(ids) < ck.TINY_VOCAB_SIZE  # fillers are never produced by encoding
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT


def test_unknown_names_raise_config_error_listing_choices(tmp_path):
    with pytest.raises(ConfigError, match="tiny.*qwen3-0.6b.*llama-3.1-8b"):
        ck.make_checkpoint(tmp_path, "huge")
    with pytest.raises(ConfigError, match="llama.*mistral.*qwen2.*qwen3"):
        ck.make_checkpoint(tmp_path, "tiny", "gpt2")
    with pytest.raises(ConfigError, match="bfloat16"):
        ck.make_checkpoint(tmp_path, "tiny", dtype="int8")
    with pytest.raises(ConfigError, match="max_shard_size"):
        ck.make_checkpoint(tmp_path, "tiny", max_shard_size=0)
    assert not list(tmp_path.iterdir())  # nothing written before the error


def _cli(argv):
    parser = argparse.ArgumentParser(prog="ostinato")
    ck.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_cli_writes_sharded_checkpoint_and_reports_it(tmp_path, capsys):
    args = _cli(["make-checkpoint", str(tmp_path / "m"), "--family", "mistral", "--seed", "3", "--sharded",
                 "--quiet"])
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip()
    assert "MistralForCausalLM" in line and f"{ck.parameter_count('tiny'):,} parameters" in line
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    shards = len(set(index["weight_map"].values()))
    assert shards > 1 and line.endswith(f"in {shards} files -> {tmp_path / 'm'}")
    assert _cli(["make-checkpoint", "x", "--max-shard-size", "2GB"]).max_shard_size == 2 * 10**9
    assert _cli(["make-checkpoint", "x", "--max-shard-size", "1024"]).max_shard_size == 1024
    with pytest.raises(SystemExit):
        _cli(["make-checkpoint", "x", "--max-shard-size", "lots"])
    with pytest.raises(SystemExit):
        _cli(["make-checkpoint", "x", "--shape", "huge"])


@pytest.mark.parametrize("layout,scale_suffix", [("block", "weight_scale_inv"), ("compressed-tensors", "weight_scale")])
def test_cli_writes_sharded_fp8_checkpoints_whose_index_names_the_scales(tmp_path, capsys, layout, scale_suffix):
    pytest.importorskip("compressed_tensors")
    from ostinato.attention.torch_ref import TorchRefBackend
    from ostinato.kernels.fp8_linear import Fp8Linear
    from ostinato.model.loader import load_model

    out = tmp_path / layout
    args = _cli(["make-checkpoint", str(out), "--shape", "tiny-128", "--sharded", "--quiet", "--quantization", "fp8",
                 "--fp8-layout", layout])
    assert args.func(args) == 0 and f"(projections fp8, {layout})" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == ("fp8" if layout == "block" else "compressed-tensors")
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.down_proj."
    assert weight_map[name + "weight"] == weight_map[name + scale_suffix]  # the scale sits in its weight's shard
    assert len(set(weight_map.values())) > 1 and "model.embed_tokens." + scale_suffix not in weight_map
    tensors = {}
    for shard in set(weight_map.values()):
        tensors.update(load_file(str(out / shard)))
    assert tensors[name + "weight"].dtype == torch.float8_e4m3fn and tensors["lm_head.weight"].dtype == torch.float32
    model = load_model(out, ModelConfig.from_dir(out), torch.float32, torch.device("cpu"), TorchRefBackend(),
                       progress=False)
    assert isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)


def test_fp8_layout_needs_quantization(tmp_path):
    args = _cli(["make-checkpoint", str(tmp_path / "m"), "--fp8-layout", "block", "--quiet"])
    with pytest.raises(ConfigError, match="--fp8-layout needs --quantization fp8"):
        args.func(args)
    with pytest.raises(ConfigError, match="unknown FP8 layout"):
        ck.make_checkpoint(tmp_path / "n", fp8_layout="int4")
