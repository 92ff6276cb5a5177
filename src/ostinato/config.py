"""Frozen configuration, one dataclass per concern; each component receives only its own.

`EngineArgs` is the flat, user-facing set of flags (CLI and `LLM(**kwargs)`); `EngineArgs.resolve()`
checks them against the checkpoint and splits them into the per-component configs below.
Pure Python: no torch import here, so the scheduler side can use these too.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ostinato.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    """The architecture facts the decoder needs, read from an HF `config.json`."""

    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # RMSNorm on q and k per head before RoPE (Qwen3)
    rope_scaling: dict[str, Any] | None = None
    checkpoint_dtype: str = "float32"  # torch_dtype / dtype written in config.json
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # Sliding-window attention (some Mistral checkpoints) is not implemented: attention is full, so such a
    # model is exact only up to this many tokens and max_model_len is capped there.
    sliding_window: int | None = None

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; ostinato loads "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = cfg.get("rope_theta")
            # transformers >= 5 may write rope settings under "rope_parameters".
            rope_params = cfg.get("rope_parameters")
            if isinstance(rope_params, dict):
                rope_theta = rope_theta or rope_params.get("rope_theta")
                if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
                    rope_scaling = dict(rope_params)
            if rope_scaling is not None:
                kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
                if kind in (None, "default"):
                    rope_scaling = None
                elif kind != "llama3":
                    raise CheckpointError(
                        f"rope_scaling type {kind!r} is not supported; ostinato supports 'llama3' and none"
                    )
            return ModelConfig(
                architecture=arch,
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta or 10000.0),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                qk_norm=family == "qwen3",
                rope_scaling=rope_scaling,
                checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
                sliding_window=(int(cfg["sliding_window"]) if cfg.get("sliding_window")
                                and cfg.get("use_sliding_window", True) else None),
            )
        except KeyError as e:
            raise CheckpointError(f"config.json lacks the required field {e.args[0]!r}") from None

    @staticmethod
    def from_dir(model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise CheckpointError(f"model folder {str(model_dir)!r} does not exist")
        if not path.is_file():
            raise CheckpointError(f"{path} is missing: a model folder needs an HF config.json")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from None
        return ModelConfig.from_hf_dict(cfg)


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# The offline API (LLM, and so `bench throughput`) defaults to a larger step budget, as vLLM's LLM class does:
# a batch job wants throughput, not the gap between one stream's tokens. At 8192, prefix caching + chunking
# cost nano-vllm's workload nothing measurable, while the server's 2048 cost a few percent (smaller steps: more
# mixed steps; docs/PERFORMANCE.md, "Why these defaults"). A prompt longer than the budget is still chunked.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 8192


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache. num_blocks is the number of usable blocks (the runner adds one scratch block
    that padded decode rows write into; the scheduler never hands it out)."""

    block_size: int
    num_blocks: int
    # Prefix caching (engine/blocks.py). The engine turns it on (EngineArgs.enable_prefix_caching, default on)
    # and names the model and dtype in the salt, which keys a sequence's first block.
    enable_prefix_caching: bool = False
    prefix_cache_salt: str = ""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    max_queued_requests: int | None = None

    def __post_init__(self) -> None:
        # Checked here, once, for configs from EngineArgs and configs built by hand alike.
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every decode row runs every step and counts against the budget; a prompt is prefilled in chunks of
            # what is left, so any budget >= max_num_seqs serves every prompt.
            raise ConfigError(
                f"--max-num-batched-tokens {self.max_num_batched_tokens} is smaller than --max-num-seqs "
                f"{self.max_num_seqs}: a step decodes up to max-num-seqs sequences, one token each; raise "
                "--max-num-batched-tokens or lower --max-num-seqs")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split: tensor_parallel_size ranks (one process, one GPU each; runner/distributed.py)."""

    tensor_parallel_size: int = 1


@dataclass(frozen=True)
class GraphConfig:
    """How decode steps run. capture_sizes is sorted ascending; empty when graphs are off."""

    enforce_eager: bool
    capture_sizes: tuple[int, ...]
    fallback: str  # "error" (default: capture failure stops start-up) | "eager"
    skip_graph_check: bool
    # Prefill chunks as graph replays (runner/prefill_graphs.py): the token counts captured, ascending (empty:
    # every prefill step eager), and the most sequences one captured step holds.
    prefill_sizes: tuple[int, ...] = ()
    prefill_max_seqs: int = 0
    # A mixed step (decode rows + prefill chunks): "one-replay" runs both in one prefill-graph replay when the
    # step fits one (the weights read once), "two-replays" the decode replay then the chunks (runner/runner.py).
    mixed_step: str = "one-replay"


def default_capture_sizes(max_num_seqs: int, max_size: int = 256) -> tuple[int, ...]:
    """1, 2, 4, then steps of 8 up to min(max_size, max_num_seqs); the cap itself is always included."""
    cap = max(1, min(max_size, max_num_seqs))
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return tuple(sorted(set(sizes)))


def plan_capture_sizes(
    max_num_seqs: int,
    cuda_graph_sizes: Sequence[int] | None = None,
    max_cuda_graph_size: int | None = None,
) -> tuple[int, ...]:
    """The batch sizes to capture, ascending.

    Default: 1, 2, 4, then steps of 8 up to min(max_cuda_graph_size or 256, max_num_seqs), that cap
    included. An explicit list is sorted and deduplicated; sizes above max_num_seqs (a decode batch never
    has more sequences) or above max_cuda_graph_size are dropped with a WARNING saying why.
    """
    if max_num_seqs < 1:
        raise ConfigError(f"--max-num-seqs must be >= 1, got {max_num_seqs}")
    if max_cuda_graph_size is not None and max_cuda_graph_size < 1:
        raise ConfigError(f"--max-cuda-graph-size must be >= 1, got {max_cuda_graph_size}")
    if cuda_graph_sizes is None:
        return default_capture_sizes(max_num_seqs, max_cuda_graph_size or 256)

    sizes = tuple(cuda_graph_sizes)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int) or s < 1]
    if not sizes or bad:
        raise ConfigError(f"--cuda-graph-sizes must be positive integers, got {list(sizes)}")
    kept, dropped = [], []
    for size in sorted(set(sizes)):
        if size > max_num_seqs:
            dropped.append(f"{size} (above --max-num-seqs {max_num_seqs}: no decode batch is that large)")
        elif max_cuda_graph_size is not None and size > max_cuda_graph_size:
            dropped.append(f"{size} (above --max-cuda-graph-size {max_cuda_graph_size})")
        else:
            kept.append(size)
    if not kept:
        raise ConfigError(
            f"none of --cuda-graph-sizes {sorted(set(sizes))} can be used: {'; '.join(dropped)}. Pass sizes "
            "<= --max-num-seqs (and --max-cuda-graph-size), or run with --enforce-eager"
        )
    if dropped:
        logger.warning("not capturing CUDA graphs for --cuda-graph-sizes %s", "; ".join(dropped))
    return tuple(kept)


# Token counts of the captured prefill graphs. Why these (llama-3.1-8b, bf16): an eager forward of up to ~480
# tokens costs more in host-side launches than in GPU work, whatever its size; by ~512 tokens the GPU work
# catches up with the launches, so above that a graph saves little and eager runs. The 1.5x steps bound padding
# to a third of a replay's tokens.
# Graph memory is that of the largest size (all sizes share one pool): its activations, tens of MiB on the 8B.
DEFAULT_PREFILL_GRAPH_TOKENS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# A captured prefill step holds up to this many sequences (a chunk beside running decodes is one; a burst of
# short prompts more). Unused sequence slots cost one early-returning program per query tile and KV head.
DEFAULT_PREFILL_GRAPH_MAX_SEQS = 16
MIXED_STEPS = ("one-replay", "two-replays")
PDL_MODES = ("auto", "on", "off")  # --pdl (kernels/pdl.py)


def plan_prefill_graph_tokens(max_num_batched_tokens: int, given: Sequence[int] | None = None) -> tuple[int, ...]:
    """The prefill token counts to capture, ascending. Default: DEFAULT_PREFILL_GRAPH_TOKENS below the step's
    token budget, plus the budget itself when it is within the largest (a step never holds more tokens, and a
    chunk that fills the budget then replays unpadded). Given sizes above the budget are dropped with a
    WARNING (no step holds that many tokens); an empty tuple turns prefill graphs off."""
    if given is None:
        sizes = [s for s in DEFAULT_PREFILL_GRAPH_TOKENS if s < max_num_batched_tokens]
        if max_num_batched_tokens <= DEFAULT_PREFILL_GRAPH_TOKENS[-1]:
            sizes.append(max_num_batched_tokens)
        return tuple(sorted(set(sizes)))
    kept = tuple(sorted({s for s in given if s <= max_num_batched_tokens}))
    dropped = sorted({s for s in given if s > max_num_batched_tokens})
    if dropped:
        logger.warning("not capturing prefill graphs for --prefill-graph-tokens %s: above "
                       "--max-num-batched-tokens %d, no step holds that many tokens", dropped, max_num_batched_tokens)
    return kept


def read_prefill_graph_tokens(text: str) -> tuple[int, ...]:
    """--prefill-graph-tokens as written: integers ('16 32 64' or '16,32,64'), or 'none' (no prefill graphs)."""
    if text.strip().lower() in ("none", "off", ""):
        return ()
    try:
        sizes = tuple(int(w) for w in text.replace(",", " ").split())
    except ValueError:
        raise ConfigError(f"--prefill-graph-tokens must hold integers like '16 32 64' or 'none', got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise ConfigError(f"--prefill-graph-tokens must hold positive integers, got {list(sizes)}")
    return sizes


def read_cuda_graph_sizes(text: str) -> tuple[int, ...]:
    """--cuda-graph-sizes as the user wrote it: integers ('1 2 4 8' or '1,2,4,8'), or '@FILE' naming a file
    that holds them (what `ostinato advise` writes): whitespace/comma separated, '#' starts a comment; a
    JSON list or a JSON object with a "cuda_graph_sizes" list is accepted too."""
    source = "--cuda-graph-sizes"
    if text.startswith("@"):
        path = Path(text[1:])
        source = f"--cuda-graph-sizes file {str(path)!r}"
        try:
            text = path.read_text()
        except OSError as e:
            raise ConfigError(f"cannot read {source}: {e.strerror or e}; pass an existing file after '@'") from None
        stripped = text.strip()
        if stripped.startswith(("[", "{")):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{source} is not valid JSON: {e}") from None
            if isinstance(value, dict):
                value = value.get("cuda_graph_sizes")
            if not isinstance(value, list):
                raise ConfigError(f'{source} must hold a JSON list of sizes or {{"cuda_graph_sizes": [...]}}')
            text = " ".join(str(v) for v in value)
        text = "\n".join(line.split("#", 1)[0] for line in text.splitlines())
    words = text.replace(",", " ").split()
    try:
        sizes = tuple(int(w) for w in words)
    except ValueError:
        raise ConfigError(f"{source} must hold integers like '1 2 4 8' or '1,2,4,8', got {text.strip()!r}") from None
    if not sizes or any(s < 1 for s in sizes):
        raise ConfigError(f"{source} must hold positive integers, got {list(sizes)}")
    return sizes


@dataclass(frozen=True)
class EngineArgs:
    """Every engine flag, as the CLI and `LLM(model, **kwargs)` take them (names follow vLLM)."""

    model: str
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "auto"  # auto (cuda if available) | cuda | cpu
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    # Fixed number of KV blocks instead of profiling (tests use it to force preemption; CPU default).
    num_kv_blocks: int | None = None
    attention_backend: str = "auto"  # auto (triton on cuda, torch on cpu) | torch | triton
    seed: int = 0
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    max_cuda_graph_size: int | None = None
    cuda_graph_fallback: str = "error"  # error | eager
    skip_graph_check: bool = False
    served_model_name: str | None = None
    max_queued_requests: int | None = None
    tokenizer: str | None = None
    # Overlapped scheduling: prepare and launch decode step n+1 before reading step n's tokens (vLLM's name).
    async_scheduling: bool = True
    # Ranks the model is split over (one process and one GPU each); see runner/distributed.py.
    tensor_parallel_size: int = 1
    # Reuse the K/V of full blocks of earlier requests' identical prefixes (vLLM's name; default on).
    enable_prefix_caching: bool = True
    # Prefill steps as CUDA-graph replays at these token counts (None: DEFAULT_PREFILL_GRAPH_TOKENS up to the
    # step budget; () or "none": off); a step of more tokens or more sequences runs eager, counted.
    prefill_graph_tokens: tuple[int, ...] | None = None
    prefill_graph_max_seqs: int = DEFAULT_PREFILL_GRAPH_MAX_SEQS
    # How a step with decode rows and prefill chunks runs (GraphConfig.mixed_step).
    mixed_step: str = "one-replay"
    # Programmatic dependent launch of the Triton kernels (kernels/pdl.py): auto (where the GPU and triton support it),
    # on (an error where they do not) or off.
    pdl: str = "auto"

    def __post_init__(self) -> None:
        if isinstance(self.cuda_graph_sizes, str):  # "@FILE" (or "1,2,4") from LLM(cuda_graph_sizes=...)
            object.__setattr__(self, "cuda_graph_sizes", read_cuda_graph_sizes(self.cuda_graph_sizes))
        if self.cuda_graph_sizes is not None and not isinstance(self.cuda_graph_sizes, tuple):
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
        if isinstance(self.prefill_graph_tokens, str):
            object.__setattr__(self, "prefill_graph_tokens", read_prefill_graph_tokens(self.prefill_graph_tokens))
        if self.prefill_graph_tokens is not None and not isinstance(self.prefill_graph_tokens, tuple):
            object.__setattr__(self, "prefill_graph_tokens", tuple(self.prefill_graph_tokens))
        checks = [
            (self.dtype in ("auto", "bfloat16", "float16", "float32", "bf16", "fp16", "fp32"),
             f"--dtype must be auto, bfloat16, float16 or float32, got {self.dtype!r}"),
            (self.device in ("auto", "cuda", "cpu"), f"--device must be auto, cuda or cpu, got {self.device!r}"),
            (self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}"),
            (self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"--block-size must be a power of two, got {self.block_size}"),
            (0.0 < self.gpu_memory_utilization <= 1.0,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"),
            (self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}"),
            (self.attention_backend in ("auto", "torch", "triton"),
             f"--attention-backend must be auto, torch or triton, got {self.attention_backend!r}"),
            (self.cuda_graph_fallback in ("error", "eager"),
             f"--cuda-graph-fallback must be 'error' or 'eager', got {self.cuda_graph_fallback!r}"),
            (self.cuda_graph_sizes is None or (len(self.cuda_graph_sizes) > 0 and all(
                isinstance(s, int) and s >= 1 for s in self.cuda_graph_sizes)),
             f"--cuda-graph-sizes must be positive integers, got {self.cuda_graph_sizes}"),
            (self.max_cuda_graph_size is None or self.max_cuda_graph_size >= 1,
             f"--max-cuda-graph-size must be >= 1, got {self.max_cuda_graph_size}"),
            (self.prefill_graph_tokens is None or all(
                isinstance(s, int) and s >= 1 for s in self.prefill_graph_tokens),
             f"--prefill-graph-tokens must be positive integers or 'none', got {self.prefill_graph_tokens}"),
            (self.mixed_step in MIXED_STEPS,
             f"--mixed-step must be one of {', '.join(MIXED_STEPS)}, got {self.mixed_step!r}"),
            (self.pdl in PDL_MODES, f"--pdl must be one of {', '.join(PDL_MODES)}, got {self.pdl!r}"),
            (self.prefill_graph_max_seqs >= 1,
             f"--prefill-graph-max-seqs must be >= 1, got {self.prefill_graph_max_seqs}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"--max-model-len must be >= 1, got {self.max_model_len}"),
            (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             f"--tensor-parallel-size must be an integer >= 1, got {self.tensor_parallel_size!r}"),
            (self.tensor_parallel_size == 1 or self.cuda_graph_fallback == "error",
             "--cuda-graph-fallback eager cannot be used with --tensor-parallel-size > 1: every rank must run "
             "the same decode path, so a capture failure on any rank stops start-up; drop the flag or use "
             "--enforce-eager"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def scheduler_config(self, model: ModelConfig) -> SchedulerConfig:
        limit = model.max_position_embeddings
        if model.sliding_window is not None and model.sliding_window < limit:
            limit = model.sliding_window
            if self.max_model_len and self.max_model_len > limit:
                raise ConfigError(
                    f"this checkpoint uses sliding-window attention ({limit} tokens), which ostinato does not "
                    f"implement; it is exact up to {limit} tokens: set --max-model-len {limit} or lower")
        max_len = self.max_model_len or min(limit, 8192)
        if max_len > model.max_position_embeddings:
            raise ConfigError(
                f"--max-model-len {max_len} exceeds the model's max_position_embeddings "
                f"{model.max_position_embeddings}; lower --max-model-len"
            )
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            # Chunked prefill: a step's tokens (decode rows + prefill chunks). The default trades a little prefill
            # efficiency for running decodes that never wait behind more than ~2k prompt tokens.
            max_num_batched_tokens=self._max_num_batched_tokens(),
            max_model_len=max_len,
            max_queued_requests=self.max_queued_requests,
        )

    def _max_num_batched_tokens(self) -> int:
        return self.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_num_seqs)

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size)

    def graph_config(self, device_is_cuda: bool) -> GraphConfig:
        if self.enforce_eager or not device_is_cuda:
            return GraphConfig(True, (), self.cuda_graph_fallback, self.skip_graph_check)
        sizes = plan_capture_sizes(self.max_num_seqs, self.cuda_graph_sizes, self.max_cuda_graph_size)
        prefill = plan_prefill_graph_tokens(self._max_num_batched_tokens(), self.prefill_graph_tokens)
        return GraphConfig(False, sizes, self.cuda_graph_fallback, self.skip_graph_check, prefill,
                           min(self.prefill_graph_max_seqs, self.max_num_seqs), self.mixed_step)
