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
import contextlib
import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ostinato.config import ModelConfig
from ostinato.errors import ConfigError

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
DTYPES = ("float32", "bfloat16", "float16")
# Public checkpoints ship 2-5 GB shards; 4 GB keeps Llama-3.2-1B in one file and splits 8B into five.
DEFAULT_MAX_SHARD_SIZE = 4 * 10**9

BEGIN_OF_TEXT, END_OF_TEXT = "<|begin_of_text|>", "<|end_of_text|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (BEGIN_OF_TEXT, END_OF_TEXT, IM_START, IM_END)  # ids 0..3: the BPE trainer puts them first
TINY_VOCAB_SIZE = 512


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
SHAPES: dict[str, Shape] = {
    "tiny": Shape(**_TINY),
    "tiny-tied": Shape(**{**_TINY, "tie_word_embeddings": True}),
    # Tensor-parallel corner cases at test size: one KV head (replicated on every rank), a vocabulary no
    # rank count above 1 divides (the last rank's rows are padding) and a tied lm_head (split like the table).
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
        max_position_embeddings=131072, rms_norm_eps=1e-5, init_std=0.02, final_norm_gain=3.0, rope_scaling=(
            ("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
            ("original_max_position_embeddings", 8192))),
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
        eos_token_id=_eos_token_ids(),
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


# -------------------------------------------------------------------------------------------- tokenizer

# Training text for the tiny BPE. Plain English, so round-trip tests and prompts tokenize into real merges.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. A small engine can run a large model if it keeps the work
close to the hardware and does not waste time between steps. Every step of decoding reads all the
weights once, writes one new token into the cache, and then hands the result back to the scheduler.

Once upon a time there was a little town by the river. The people of the town grew apples and pears,
and in the autumn they carried their baskets to the market in the square. Children played near the
water while their parents talked about the weather, the price of bread and the news from the city.

Language models predict the next word from the words that came before it. They are trained on a great
amount of text written by people: books, letters, articles, questions and answers. When you ask a
question, the model writes an answer one piece at a time, and each piece depends on everything before.

Good software is tested with care. Write a small example first, check that it works, and then make it
faster. Measure before you change anything, and measure again afterwards, because the numbers often
surprise even the people who wrote the code. Simple things that are correct are better than clever
things that are wrong.

The weather today is sunny with a few clouds in the afternoon. Tomorrow there may be rain in the
morning, so bring an umbrella if you are going out early. The weekend should be warm and dry, which is
good news for anyone who wants to walk in the hills or sit in the garden with a book.

What is the capital of France? Paris is the capital of France, and it is known for its museums, its
food and the long walks along the river. How many days are there in a week? There are seven days in a
week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday. Numbers like 1, 2, 3, 10, 42
and 2024 appear in text too, as do symbols such as (brackets), "quotes", commas, colons; and dashes.
"""

_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _eos_token_ids() -> list[int]:
    return [SPECIAL_TOKENS.index(END_OF_TEXT), SPECIAL_TOKENS.index(IM_END)]


def _filler_tokens(count: int, taken: set[str]) -> list[str]:
    """`count` distinct pseudo-words (" bazo", " kifute", ...) not in `taken`, in byte-level form.

    They pad the BPE vocabulary up to the model's vocab_size: no merge produces them, so encoding never
    yields them, but a random model does, and each then decodes to readable text of a realistic length
    instead of being dropped (which is what `decode` does with ids beyond the vocabulary).
    """
    syllables = [c + v for c in "bdfghklmnprstvz" for v in "aeiou"]  # 75
    words: list[str] = []
    index = 0
    while len(words) < count:
        n, parts = index, []
        while True:  # bijective base-75: every index gives a distinct syllable string
            parts.append(syllables[n % 75])
            n = n // 75 - 1
            if n < 0:
                break
        word = "\u0120" + "".join(parts)  # \u0120 is the byte-level form of a leading space
        if word not in taken:
            words.append(word)
        index += 1
    return words


# Qwen2's pre-tokenizer split (GPT-4 style). Using Qwen's exact pipeline for every family matters: for
# model_type qwen2, transformers 5 rebuilds the tokenizer from vocab + merges with this pipeline whatever
# tokenizer.json says, so any other pipeline would load differently there.
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)


def build_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, add_bos: bool = True):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` tokens (special tokens at 0..3).

    Trained on the built-in corpus (deterministic: the trainer breaks ties by pair id), then padded
    with filler tokens up to `vocab_size`. `add_bos` prepends <|begin_of_text|> when encoding, as the
    Llama tokenizers do (Qwen's do not).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, TINY_VOCAB_SIZE), special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS.split("\n\n"), trainer)
    vocab = tokenizer.get_vocab()
    if len(vocab) < vocab_size:
        merges = json.loads(tokenizer.to_str())["model"]["merges"]  # [[left, right], ...]
        fillers = _filler_tokens(vocab_size - len(vocab), set(vocab))
        vocab.update({token: len(vocab) + i for i, token in enumerate(fillers)})
        tokenizer.model = models.BPE(vocab=vocab, merges=[tuple(m) for m in merges])
    if add_bos:
        bos_id = SPECIAL_TOKENS.index(BEGIN_OF_TEXT)
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BEGIN_OF_TEXT} $A", pair=f"{BEGIN_OF_TEXT} $A {BEGIN_OF_TEXT} $B",
            special_tokens=[(BEGIN_OF_TEXT, bos_id)],
        )
    assert tokenizer.get_vocab_size() == vocab_size, (tokenizer.get_vocab_size(), vocab_size)
    return tokenizer


def write_tokenizer(out_dir: str | Path, vocab_size: int = TINY_VOCAB_SIZE, family: str = "llama",
                    model_max_length: int = 2048) -> None:
    """Write tokenizer.json and tokenizer_config.json (ChatML template) for `family` into `out_dir`.

    Llama and Mistral tokenizers prepend <|begin_of_text|> and their chat template starts with it;
    Qwen2/Qwen3 ones do neither, as with the real models.
    """
    out = Path(out_dir)
    add_bos = family in ("llama", "mistral")
    build_tokenizer(vocab_size, add_bos).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BEGIN_OF_TEXT,
        "eos_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
        "unk_token": None,  # byte-level BPE needs none (and transformers' Qwen2Tokenizer would add one)
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        # Byte-level BPE round-trips text exactly; the "cleanup" would rewrite " ," as ",".
        "clean_up_tokenization_spaces": False,
        # Llama 3's template starts with the BOS token itself (chat prompts are encoded without specials).
        "chat_template": ("{{- bos_token }}" if add_bos else "") + _CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# ---------------------------------------------------------------------------------------------- weights

_CHUNK_NUMEL = 1 << 22  # elements per draw: fine enough that all threads share even one big tensor
_POOL_MIN_BYTES = 64 << 20  # below this a thread pool costs more than it saves


def _chunk_seed(seed: int, name: str, chunk: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _fill_chunk(flat, name: str, chunk: int, seed: int, spec: Shape) -> None:
    """Draw chunk `chunk` of the flattened tensor `flat` in place, in its own dtype.

    Drawing bf16 directly is about as fast as drawing fp32 and casting, and it keeps each worker thread to a
    single serial op: a cast would open an OpenMP team inside every worker and oversubscribe the cores.
    """
    import torch

    out = flat[chunk * _CHUNK_NUMEL:(chunk + 1) * _CHUNK_NUMEL]
    generator = torch.Generator().manual_seed(_chunk_seed(seed, name, chunk))
    if name == "model.norm.weight":
        out.uniform_(0.5 * spec.final_norm_gain, 1.5 * spec.final_norm_gain, generator=generator)
    elif name.endswith("norm.weight"):
        out.uniform_(0.5, 1.5, generator=generator)  # RMSNorm gains around 1, far enough to test them
    else:
        out.normal_(0.0, spec.init_std, generator=generator)


def _random_tensors(shapes: dict[str, tuple[int, ...]], dtype, seed: int, spec: Shape, pool,
                    on_chunk_done=None) -> dict[str, Any]:
    """Draw the named tensors; `pool` (a thread pool or None) shares the chunks out, `on_chunk_done(nbytes)`
    reports progress."""
    import torch

    tensors = {name: torch.empty(dims, dtype=dtype) for name, dims in shapes.items()}
    jobs = [
        (tensor.view(-1), name, chunk)
        for name, tensor in tensors.items()
        for chunk in range((tensor.numel() + _CHUNK_NUMEL - 1) // _CHUNK_NUMEL)
    ]

    def draw(job) -> None:
        flat, name, chunk = job
        _fill_chunk(flat, name, chunk, seed, spec)
        if on_chunk_done is not None:
            on_chunk_done(min(_CHUNK_NUMEL, flat.numel() - chunk * _CHUNK_NUMEL) * flat.element_size())

    # torch releases the GIL inside the draws, so a thread pool uses all cores
    list(pool.map(draw, jobs) if pool is not None else map(draw, jobs))
    return tensors


def _remove_old_weights(out: Path) -> None:
    """Delete weight files a previous run left here: HF would otherwise mix stale and new layouts."""
    for path in out.iterdir():
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?", path.name):
            path.unlink()


def _write_weights(out: Path, config: dict[str, Any], dtype_name: str, seed: int, spec: Shape,
                   max_shard_size: int, progress: bool) -> int:
    """Write the safetensors files shard by shard (memory stays at one shard); returns bytes written."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from tqdm import tqdm

    dtype = getattr(torch, dtype_name)
    shapes = weight_shapes(config)
    # Plan on meta tensors: huggingface_hub's splitter needs only sizes, nothing is allocated.
    plan = split_torch_state_dict_into_shards(
        {name: torch.empty(dims, dtype=dtype, device="meta") for name, dims in shapes.items()},
        max_shard_size=max_shard_size,
    )
    total = plan.metadata["total_size"]
    threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    use_pool = threads > 1 and total >= _POOL_MIN_BYTES
    # delay: quick (tiny) writes print no bar at all. tqdm.update is thread-safe.
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=not progress, delay=1.0)
    with ThreadPoolExecutor(threads) if use_pool else contextlib.nullcontext() as pool:
        n_shards = len(plan.filename_to_tensors)
        for i, (filename, names) in enumerate(plan.filename_to_tensors.items()):
            bar.set_description(f"drawing shard {i + 1}/{n_shards}", refresh=False)
            tensors = _random_tensors({n: shapes[n] for n in names}, dtype, seed, spec, pool, bar.update)
            bar.set_description(f"writing shard {i + 1}/{n_shards}", refresh=False)
            save_file(tensors, str(out / filename), metadata={"format": "pt"})
            del tensors  # before drawing the next shard: memory stays at one shard
    bar.close()
    if plan.is_sharded:
        index = {"metadata": {"total_size": total}, "weight_map": plan.tensor_to_filename}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


# ------------------------------------------------------------------------------------------ entry point


def make_checkpoint(out_dir: str | Path, shape: str = "tiny", family: str | None = None, seed: int = 0,
                    dtype: str = "float32", max_shard_size: int | None = None, progress: bool = False) -> Path:
    """Write a random-weight HF checkpoint folder of `shape` as `family` into `out_dir`; returns its path.

    `family=None` uses the shape's own family. `max_shard_size` (bytes) splits the weights into shards with
    model.safetensors.index.json (default 4 GB: tiny shapes get one model.safetensors). The same seed
    gives the same weights whatever the shard layout. Raises ConfigError for unknown names or sizes.
    """
    spec, family = _resolve(shape, family)
    config = hf_config_dict(shape, family, dtype)
    if max_shard_size is not None and max_shard_size <= 0:
        raise ConfigError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(out)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    from transformers import GenerationConfig

    GenerationConfig(bos_token_id=config["bos_token_id"], eos_token_id=_eos_token_ids()).save_pretrained(out)
    write_tokenizer(out, spec.vocab_size, family, spec.max_position_embeddings)
    _write_weights(out, config, dtype, seed, spec, max_shard_size or DEFAULT_MAX_SHARD_SIZE, progress)
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


def run(args: argparse.Namespace) -> int:
    """CLI entry: write the checkpoint and print one line describing it."""
    max_shard_size = args.max_shard_size
    if args.sharded:
        total = parameter_count(args.shape, args.family) * (4 if args.dtype == "float32" else 2)
        max_shard_size = max(1, total // 4)
    out = make_checkpoint(args.out_dir, shape=args.shape, family=args.family, seed=args.seed, dtype=args.dtype,
                          max_shard_size=max_shard_size, progress=not args.quiet)
    config = json.loads((out / "config.json").read_text())
    files = sorted(out.glob("*.safetensors"))
    size = sum(f.stat().st_size for f in files)
    size_text = f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.2f} MB"
    print(f"wrote {args.shape} ({config['architectures'][0]}, seed {args.seed}): "
          f"{parameter_count(args.shape, args.family):,} parameters, {size_text} {args.dtype} "
          f"in {len(files)} file{'s' if len(files) > 1 else ''} -> {out}")
    return 0
