"""`ostinato make-checkpoint`: random-weight, HF-format checkpoint folders that transformers itself loads.

Nothing can download weights where ostinato is tested, so tests and benchmarks build their own models:
config.json (written by transformers' own config classes), safetensors weights (one file, or shards with
model.safetensors.index.json), a byte-level BPE tokenizer trained here on a built-in English text
(tokenizer.json, tokenizer_config.json with a ChatML chat template) and generation_config.json.

Shapes: `tiny*` for tests (hidden 64, 2 layers, vocab = tokenizer size), and public shapes with the real
figures of Qwen3-0.6B, Llama-3.2-1B and Llama-3.1-8B for benchmarks. Every tensor is drawn from its own
generator seeded by (seed, tensor name, chunk), so the weights depend on the seed and dtype alone: not on
the shard layout, nor on the number of threads that drew them.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ostinato.config import ModelConfig
from ostinato.errors import ConfigError
from ostinato.tools.checkpoint_tokenizer import (  # noqa: F401 (re-exported: the tokenizer's names)
    BEGIN_OF_TEXT, END_OF_TEXT, IM_END, IM_START, SPECIAL_TOKENS, TINY_VOCAB_SIZE, build_tokenizer, eos_token_ids,
    write_tokenizer,
)
from ostinato.tools.checkpoint_fp8 import FP8_LAYOUTS, quantization_config, to_fp8_layout
from ostinato.tools.checkpoint_gguf import GGUF_TYPES, write_gguf
from ostinato.tools.checkpoint_weights import remove_old_weights, write_weights

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DTYPES = ("float32", "bfloat16", "float16")
# Public checkpoints ship 2-5 GB shards; 4 GB keeps Llama-3.2-1B in one file and splits 8B into five.
DEFAULT_MAX_SHARD_SIZE = 4 * 10**9



@dataclass(frozen=True)
class Shape:
    """Dimensions of a model, independent of the family that gives them an architecture."""

    family: str  # the default family (make_checkpoint's family=None)
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    init_std: float  # std of the normal draws for projections, embeddings and biases
    final_norm_gain: float = 1.0  # model.norm.weight is drawn in [0.5, 1.5] * gain: scales the logits
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # HF rope_scaling as (key, value) pairs


# Scales, measured with HF greedy decoding (16 tokens from several prompts, fp32): what matters is
# c = init_std * sqrt(hidden_size), the typical size of a projection's output. At c ~ 0.6 (std 0.02 at
# Qwen3-0.6B's hidden 1024) attention is nearly uniform and greedy decoding repeats one token; at c ~ 1.3-1.6
# every shape checked (tiny in all families, Qwen3-0.6B, Llama-3.2-1B) gives 13-16 distinct tokens in 16.
# The final norm gain then sets the logits' std to ~c * gain ~ 3-4: a clear top token (top-1 probability
# ~0.2-0.4, top-1/top-2 gaps far above the ~1e-5 by which fp32 implementations differ), still worth sampling.
_TINY = dict(
    family="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=TINY_VOCAB_SIZE, tie_word_embeddings=False, rope_theta=10000.0,
    max_position_embeddings=2048, rms_norm_eps=1e-6,
    init_std=0.2, final_norm_gain=2.0,
)
# Llama 3.1's long-context RoPE (8B and 70B alike).
_LLAMA31_ROPE_SCALING = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                         ("original_max_position_embeddings", 8192))
SHAPES: dict[str, Shape] = {
    "tiny": Shape(**_TINY),
    "tiny-tied": Shape(**{**_TINY, "tie_word_embeddings": True}),
    # Rows of 256 weights and more, the k-quants' block (GGUF Q4_K/Q5_K/Q6_K), still test-sized.
    "tiny-256": Shape(**{**_TINY, "hidden_size": 256, "head_dim": 64, "intermediate_size": 512,
                         "init_std": 0.1}),
    # Tensor-parallel corner cases at test size: one KV head (replicated on every rank), a vocabulary no
    # rank count above 1 divides (the last rank's rows are padding) and a tied lm_head (split like the table).
    # Block-scaled FP8 at test size: q (256 rows), k, v (128 each) and gate, up (256 each) start and end on
    # 128-row blocks, as the fused projections need (model/fp8_weights.py).
    "tiny-128": Shape(**{**_TINY, "hidden_size": 128, "head_dim": 64, "intermediate_size": 256, "init_std": 0.14}),
    "tiny-mqa": Shape(**{**_TINY, "num_kv_heads": 1, "vocab_size": 509, "tie_word_embeddings": True}),
    # Llama 3's vocabulary at test size: the sampling kernels' chunk plans depend on the vocabulary
    # (tests/runner/test_compile_watch.py).
    "tiny-vocab128k": Shape(**{**_TINY, "vocab_size": 128256, "tie_word_embeddings": True}),
    # Exercises llama3 rope scaling at test size: with head_dim 16, theta 10000 and an original length of
    # 256, the rotary wavelengths (6 .. 19869 positions) fall in all three llama3 bands: kept (< 64),
    # blended (64 .. 256) and divided by the factor (> 256).
    "tiny-rope-scaled": Shape(**{**_TINY, "rope_scaling": (
        ("rope_type", "llama3"), ("factor", 4.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
        ("original_max_position_embeddings", 256))}),
    "qwen3-0.6b": Shape(
        family="qwen3", hidden_size=1024, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6,
        max_position_embeddings=40960, rms_norm_eps=1e-6, init_std=0.04, final_norm_gain=3.0),
    "llama-3.2-1b": Shape(
        family="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5, init_std=0.03, final_norm_gain=3.0, rope_scaling=(
            ("rope_type", "llama3"), ("factor", 32.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
            ("original_max_position_embeddings", 8192))),
    "llama-3.1-8b": Shape(
        family="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5, init_std=0.02, final_norm_gain=3.0,
        rope_scaling=_LLAMA31_ROPE_SCALING),
    # Does not fit one H200 in bf16 (141 GB of weights): the tensor-parallel shape. init_std keeps
    # init_std * sqrt(hidden) at ~1.4, as the scales note above asks.
    "llama-3.1-70b": Shape(
        family="llama", hidden_size=8192, num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128,
        intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False, rope_theta=500000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-5, init_std=0.016, final_norm_gain=3.0,
        rope_scaling=_LLAMA31_ROPE_SCALING),
}


def _resolve(shape: str, family: str | None) -> tuple[Shape, str]:
    if shape not in SHAPES:
        raise ConfigError(f"unknown checkpoint shape {shape!r}; choose one of {', '.join(SHAPES)}")
    spec = SHAPES[shape]
    family = family or spec.family
    if family not in FAMILIES:
        raise ConfigError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    return spec, family


# ----------------------------------------------------------------------------------------------- config


def hf_config_dict(shape: str = "tiny", family: str | None = None, dtype: str = "float32") -> dict[str, Any]:
    """The config.json contents for `shape` as `family`, produced by transformers' own config class.

    Written in full (not only fields that differ from the class defaults), so readers other than
    transformers see every field, plus the pre-v5 key names (`torch_dtype`, `rope_theta`, `rope_scaling`)
    that real hub checkpoints carry and transformers 5 still reads.
    """
    import transformers

    spec, family = _resolve(shape, family)
    if dtype not in DTYPES:
        raise ConfigError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    rope_scaling = dict(spec.rope_scaling) if spec.rope_scaling else None
    kwargs: dict[str, Any] = dict(
        architectures=[FAMILIES[family]],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=SPECIAL_TOKENS.index(BEGIN_OF_TEXT),
        eos_token_id=eos_token_ids(),
        dtype=dtype,
    )
    if family == "qwen2":
        # HF's Qwen2Attention always has q/k/v biases; say so for readers that look for the flag.
        kwargs["attention_bias"] = True
    elif family in ("llama", "qwen3"):
        kwargs["attention_bias"] = False
    if family in ("mistral", "qwen2", "qwen3"):
        kwargs["sliding_window"] = None  # full attention everywhere, as in Mistral-7B-v0.3 and Qwen
    config_class = {
        "llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
    }[family]
    config = config_class(**kwargs).to_dict()
    config.update(torch_dtype=dtype, rope_theta=spec.rope_theta, rope_scaling=rope_scaling)
    return config


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape for a Llama/Mistral/Qwen2/Qwen3 config.json dict, in HF's order.

    Read through ostinato's own ModelConfig, so biases and q/k norms appear exactly when the loader
    expects them (q/k/v biases when attention_bias, as HF's Qwen2 always has; q/k norms for Qwen3).
    """
    cfg = ModelConfig.from_hf_dict(config)
    hidden, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for proj, out_dim in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
            shapes[f"{p}self_attn.{proj}_proj.weight"] = (out_dim, hidden)
            if cfg.attention_bias:
                shapes[f"{p}self_attn.{proj}_proj.bias"] = (out_dim,)
        shapes[f"{p}self_attn.o_proj.weight"] = (hidden, q_dim)
        if cfg.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (cfg.head_dim,)
            shapes[f"{p}self_attn.k_norm.weight"] = (cfg.head_dim,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{p}input_layernorm.weight"] = (hidden,)
        shapes[f"{p}post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def parameter_count(shape: str = "tiny", family: str | None = None) -> int:
    """Number of parameters (tied embeddings counted once) of `shape` as `family`."""
    total = 0
    for dims in weight_shapes(hf_config_dict(shape, family)).values():
        n = 1
        for d in dims:
            n *= d
        total += n
    return total


# ------------------------------------------------------------------------------------------ entry point


def make_checkpoint(out_dir: str | Path, shape: str = "tiny", family: str | None = None, seed: int = 0,
                    dtype: str = "float32", max_shard_size: int | None = None, progress: bool = False,
                    fp8_layout: str | None = None) -> Path:
    """Write a random-weight HF checkpoint folder of `shape` as `family` into `out_dir`; returns its path.

    `fp8_layout` (compressed-tensors | block): the projections quantized to FP8 and stored in that layout
    (tools/checkpoint_fp8.py), the same random draws as the dense checkpoint's before quantization.
    `family=None` uses the shape's own family. `max_shard_size` (bytes) splits the weights into shards with
    model.safetensors.index.json (default 4 GB: tiny shapes get one model.safetensors). The same seed
    gives the same weights whatever the shard layout. Raises ConfigError for unknown names or sizes.
    """
    spec, family = _resolve(shape, family)
    config = hf_config_dict(shape, family, dtype)
    if fp8_layout is not None and fp8_layout not in FP8_LAYOUTS:
        raise ConfigError(f"unknown FP8 layout {fp8_layout!r}; choose one of {', '.join(FP8_LAYOUTS)}")
    if fp8_layout is not None:
        config["quantization_config"] = quantization_config(fp8_layout)
    if max_shard_size is not None and max_shard_size <= 0:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_old_weights(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=eos_token_ids()).save_pretrained(out)
    write_tokenizer(out, spec.vocab_size, family, spec.max_position_embeddings)
    transform = (lambda tensors: to_fp8_layout(tensors, fp8_layout)) if fp8_layout is not None else None
    write_weights(out, weight_shapes(config), dtype, seed, spec, max_shard_size or DEFAULT_MAX_SHARD_SIZE, progress,
                  transform)
    return out


def register(subparsers) -> argparse.ArgumentParser:
    """Add `make-checkpoint` to an argparse subparsers object (sets func=run)."""
    parser = subparsers.add_parser(
        "make-checkpoint", help="write a random-weight HF checkpoint (tests, benchmarks)",
        description="Write a random-weight HF-format checkpoint folder (config, safetensors, tokenizer) "
                    "that transformers and ostinato load. Public shapes have the real model dimensions.",
    )
    parser.add_argument("out_dir", help="folder to write (created if missing)")
    parser.add_argument("--shape", default="tiny", choices=list(SHAPES),
                        help="model dimensions (default: tiny)")
    parser.add_argument("--family", choices=list(FAMILIES), default=None,
                        help="architecture (default: the shape's own family)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds every weight: same seed and dtype, same bytes (default: 0)")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float32",
                        help="weight dtype (default: float32)")
    shards = parser.add_mutually_exclusive_group()
    shards.add_argument("--max-shard-size", type=_parse_size, default=None, metavar="SIZE",
                        help="largest shard, in bytes or with a unit (500MB, 2GB); default 4GB")
    shards.add_argument("--sharded", action="store_true",
                        help="split even a small checkpoint into several shards (tests the sharded layout)")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="store the projection weights as FP8 E4M3 (embeddings, norms and lm_head stay in "
                             "--dtype)")
    parser.add_argument("--fp8-layout", choices=list(FP8_LAYOUTS), default=None,
                        help="with --quantization fp8: compressed-tensors (per-channel weight_scale, the default) "
                             "or block (128x128 weight_scale_inv, quant_method 'fp8')")
    parser.add_argument("--format", choices=("hf", "gguf"), default="hf",
                        help="hf: a safetensors folder (default); gguf: OUT_DIR/model.gguf, llama.cpp's format")
    parser.add_argument("--gguf-type", choices=GGUF_TYPES, default="Q8_0",
                        help="with --format gguf: the projections' and embedding's type, or a llama.cpp mix "
                             "(Q4_K_M, Q5_K_M); norms stay F32 (default: Q8_0)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
    return parser


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def _parse_size(text: str) -> int:
    """'123', '500MB', '2GB', '1GiB' -> bytes (decimal units as HF's max_shard_size reads them)."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes or e.g. 500MB, 2GB, 1GiB")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def make_gguf_checkpoint(out_dir: str | Path, shape: str = "tiny", family: str | None = None, seed: int = 0,
                         gguf_type: str = "Q8_0", progress: bool = False) -> Path:
    """Write a random GGUF file of `shape` as `family` to out_dir/model.gguf (tools/checkpoint_gguf.py)."""
    spec, family = _resolve(shape, family)
    config = hf_config_dict(shape, family)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_gguf(out / "model.gguf", config, weight_shapes(config), family, gguf_type, seed, spec.init_std,
                      spec.final_norm_gain, progress)


def run(args: argparse.Namespace) -> int:
    """CLI entry: write the checkpoint and print one line describing it."""
    if args.format == "gguf":
        if args.quantization is not None or args.fp8_layout is not None:
            raise ConfigError("--quantization/--fp8-layout write an HF folder; with --format gguf pick the "
                              "weights' type with --gguf-type instead")
        path = make_gguf_checkpoint(args.out_dir, args.shape, args.family, args.seed, args.gguf_type,
                                    progress=not args.quiet)
        print(f"wrote {args.shape} (seed {args.seed}): {parameter_count(args.shape, args.family):,} parameters, "
              f"{path.stat().st_size / 1e6:.2f} MB {args.gguf_type} -> {path}")
        return 0
    max_shard_size = args.max_shard_size
    if args.sharded:
        total = parameter_count(args.shape, args.family) * (4 if args.dtype == "float32" else 2)
        max_shard_size = max(1, total // 4)
    if args.fp8_layout is not None and args.quantization is None:
        raise ConfigError("--fp8-layout needs --quantization fp8")
    layout = (args.fp8_layout or FP8_LAYOUTS[0]) if args.quantization == "fp8" else None
    out = make_checkpoint(args.out_dir, shape=args.shape, family=args.family, seed=args.seed, dtype=args.dtype,
                          max_shard_size=max_shard_size, progress=not args.quiet, fp8_layout=layout)
    config = json.loads((out / "config.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    size_text = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.2f} MB"
    print(f"wrote {args.shape} ({config['architectures'][0]}, seed {args.seed}): "
          f"{parameter_count(args.shape, args.family):,} parameters, {size_text} {args.dtype}"
          f"{f' (projections fp8, {layout})' if layout else ''} "
          f"in {len(files)} file{'s' if len(files) > 1 else ''} -> {out}")
    return 0
