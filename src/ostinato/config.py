"""Frozen configuration, one dataclass per concern; each component receives only its own.

`EngineArgs` is the flat, user-facing set of flags (CLI and `LLM(**kwargs)`); `EngineArgs.resolve()`
checks them against the checkpoint (read there, once) and splits them into an `EngineConfig` of the
per-component configs below: the scheduler's, the graphs', the parallel layout and the `RunnerConfig` every
rank's runner is built from. The checkpoint's own facts are in model_config.py, the flags that hold lists of
sizes are read in config_readers.py (both re-exported here). Pure Python: no torch import here, so the
scheduler side can use these too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ostinato.config_readers import (  # noqa: F401 - re-exported: callers import the flag readers from here
    read_generation_defaults, read_kv_cache_dtype,
    DEFAULT_PREFILL_GRAPH_MAX_SEQS, DEFAULT_PREFILL_GRAPH_TOKENS, MIXED_STEPS, PDL_MODES, default_capture_sizes,
    plan_capture_sizes, plan_prefill_graph_tokens, read_cuda_graph_sizes, read_int_list, read_prefill_graph_tokens,
    warn_dropped_prefill_graph_tokens,
)
from ostinato.errors import ConfigError
from ostinato.step_policy import (  # noqa: F401 - DEFAULT_MAX_NUM_BATCHED_TOKENS re-exported
    DEFAULT_MAX_NUM_BATCHED_TOKENS, prefill_tokens_while_decoding, step_budget,
)
from ostinato.model_config import (  # noqa: F401 - re-exported
    QUANT_METHODS, SUPPORTED_ARCHITECTURES, ModelConfig, WeightQuantization, default_served_model_name,
    looks_like_hub_id, quantization_label,
)
from ostinato.speculative_config import (SpeculativeConfig, decode_rows_per_sequence, resolve_speculative,
                                         speculative_config)

if TYPE_CHECKING:  # a type only: config stays a leaf that never imports the kernels
    from ostinato.kernels.decode_plan import DecodeTuning

logger = logging.getLogger(__name__)

# `ostinato serve` bounds its waiting queue by default (sequences: a request with n counts n; offline, unbounded):
# 256, the default --max-num-seqs, lets one more full batch wait; past that a client gets a 429 with Retry-After at
# once instead of waiting unbounded under a full KV cache. TGI bounds a public server so (--max-concurrent-requests).
SERVER_MAX_QUEUED_REQUESTS = 256


# --quantization values (None: the checkpoint's weights as stored).
QUANTIZATION_MODES = (None, "fp8")

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
    # Prompt tokens a step that also decodes may carry (None: what the budget leaves; EngineArgs resolves the
    # default, step_policy.py says why).
    max_prefill_tokens_while_decoding: int | None = None

    def __post_init__(self) -> None:
        # Checked here, once, for configs from EngineArgs and configs built by hand alike.
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        cap = self.max_prefill_tokens_while_decoding
        if cap is not None and cap < 1:
            raise ConfigError(f"--max-prefill-tokens-while-decoding must be >= 1 (or unset: the default), "
                              f"got {cap}")
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


@dataclass(frozen=True)
class KVPoolConfig:
    """How the runner sizes the paged KV pool; the CacheConfig the scheduler gets is what came of it."""

    block_size: int
    num_blocks: int | None  # a fixed count (--num-kv-blocks) instead of profiling GPU memory
    gpu_memory_utilization: float
    cache_dtype: str = "auto"  # --kv-cache-dtype: "auto" (the model's dtype) or "fp8_e4m3" (read_kv_cache_dtype)


@dataclass(frozen=True)
class RunnerConfig:
    """Everything a rank's ModelRunner is built from (every tensor-parallel rank gets the same one)."""

    model_dir: str  # an HF folder: a GGUF file or short name was resolved to one before
    model: ModelConfig
    scheduler: SchedulerConfig
    graph: GraphConfig
    kv_pool: KVPoolConfig
    dtype: str  # as asked (auto | bfloat16 | ...): the loader maps it to the torch dtype for the device
    device: str  # cuda | cpu ("auto" resolved)
    attention_backend: str  # triton | torch ("auto" resolved)
    pdl: str  # auto | on | off (kernels/pdl.py decides "auto" on the device)
    seed: int
    decode_tuning: DecodeTuning | None = None  # the Triton decode attention's launch settings; None: defaults
    # Every kernel reduces a row in an order set by that row alone (docs/ARCHITECTURE.md, "Batch-invariant mode").
    batch_invariant: bool = False
    speculative: SpeculativeConfig | None = None  # speculative decoding (speculative_config.py); None: off


@dataclass(frozen=True)
class EngineConfig:
    """EngineArgs checked against the checkpoint and split per component: what LLMEngine is built from."""

    runner: RunnerConfig
    parallel: ParallelConfig
    model_source: str  # the model as the user named it (--model: a folder, a .gguf file or a short name)
    tokenizer: str  # a folder or HF name AutoTokenizer loads
    served_model_name: str
    enable_prefix_caching: bool
    async_scheduling: bool
    # The model's sampling defaults (--generation-config): SamplingParams fields a request leaves unset take
    # these (sampling_params.with_defaults); where they came from, for the start-up log.
    generation_defaults: dict = field(default_factory=dict)
    generation_defaults_source: str | None = None

    @property
    def model(self) -> ModelConfig:
        return self.runner.model

    @property
    def scheduler(self) -> SchedulerConfig:
        return self.runner.scheduler

    @property
    def graph(self) -> GraphConfig:
        return self.runner.graph

    @property
    def speculative(self) -> SpeculativeConfig | None:
        return self.runner.speculative

    @property
    def model_dir(self) -> str:
        return self.runner.model_dir


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
    max_prefill_tokens_while_decoding: int | None = None  # SchedulerConfig's (None: its default rule)
    tokenizer: str | None = None
    revision: str | None = None  # branch, tag or commit of a hub id (ORG/NAME); None: the repository's main
    # A GGUF file converted once to a float32 folder and run in --dtype, instead of run in its own blocks.
    gguf_dequantize: bool = False
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
    # Programmatic dependent launch of the Triton kernels (kernels/pdl.py): auto (where supported), on or off.
    pdl: str = "auto"
    # The Triton decode attention's launch settings (kernels/decode_plan.py; None: its defaults; --pdl sets `pdl`).
    decode_tuning: DecodeTuning | None = None
    # A request's tokens and logprobs never depend on what else runs, on padding or on the graph size: the
    # batch-invariant kernels (docs/ARCHITECTURE.md, "Batch-invariant mode"). Slower; off by default.
    batch_invariant: bool = False
    # Defaults for what a request leaves unset (vLLM's flag): auto (generation_config.json), vllm, or a folder.
    generation_config: str = "auto"
    # "fp8": quantize a 16/32-bit checkpoint's projections to FP8 E4M3 at load, per output channel (embeddings and
    # lm_head stay as stored). An FP8 checkpoint (config.json's quantization_config) runs as stored either way.
    quantization: str | None = None
    kv_cache_dtype: str = "auto"  # vLLM's flag: auto (the model's dtype) or fp8 (E4M3, half the bytes a token)
    # Speculative decoding (vLLM's names; speculative_config.py checks them): "ngram" proposes up to
    # num_speculative_tokens tokens a step by prompt lookup, "draft" by decode steps of speculative_model (a smaller
    # model of the same vocabulary), and one forward verifies them.
    speculative_method: str | None = None
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    speculative_model: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.cuda_graph_sizes, str):  # "@FILE" (or "1,2,4") from LLM(cuda_graph_sizes=...)
            object.__setattr__(self, "cuda_graph_sizes", read_cuda_graph_sizes(self.cuda_graph_sizes))
        if self.cuda_graph_sizes is not None and not isinstance(self.cuda_graph_sizes, tuple):
            object.__setattr__(self, "cuda_graph_sizes", tuple(self.cuda_graph_sizes))
        if isinstance(self.prefill_graph_tokens, str):
            object.__setattr__(self, "prefill_graph_tokens", read_prefill_graph_tokens(self.prefill_graph_tokens))
        if self.prefill_graph_tokens is not None and not isinstance(self.prefill_graph_tokens, tuple):
            object.__setattr__(self, "prefill_graph_tokens", tuple(self.prefill_graph_tokens))
        object.__setattr__(self, "kv_cache_dtype", read_kv_cache_dtype(self.kv_cache_dtype))
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
            (self.max_queued_requests is None or self.max_queued_requests >= 1,
             f"--max-queued-requests must be >= 1 (or none: unbounded), got {self.max_queued_requests}"),
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
            (self.decode_tuning is None or (is_dataclass(self.decode_tuning) and hasattr(self.decode_tuning, "pdl")),
             f"decode_tuning must be an ostinato.kernels.decode_plan.DecodeTuning, got {self.decode_tuning!r}"),
            (self.quantization in QUANTIZATION_MODES,
             f"--quantization must be fp8 (or left out), got {self.quantization!r}"),
            (self.prefill_graph_max_seqs >= 1,
             f"--prefill-graph-max-seqs must be >= 1, got {self.prefill_graph_max_seqs}"),
            (self.max_model_len is None or self.max_model_len >= 1,
             f"--max-model-len must be >= 1, got {self.max_model_len}"),
            (isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
             f"--tensor-parallel-size must be an integer >= 1, got {self.tensor_parallel_size!r}"),
            (self.tensor_parallel_size == 1 or not self.batch_invariant,
             "--batch-invariant needs --tensor-parallel-size 1: the all-reduce of a row-parallel layer sums in an "
             "order its message size picks; drop one of the two flags"),
            (self.tensor_parallel_size == 1 or self.cuda_graph_fallback == "error",
             "--cuda-graph-fallback eager cannot be used with --tensor-parallel-size > 1: every rank must run "
             "the same decode path, so a capture failure on any rank stops start-up; drop the flag or use "
             "--enforce-eager"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        speculative_config(self)

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
            # Chunked prefill: a step's tokens, and the prompt tokens of a step that also decodes (step_policy.py).
            max_num_batched_tokens=self.step_budget(),
            max_model_len=max_len,
            max_queued_requests=self.max_queued_requests,
            max_prefill_tokens_while_decoding=self.prefill_tokens_while_decoding(),
        )

    def step_budget(self) -> int:
        return step_budget(self.max_num_batched_tokens, self.max_num_seqs)

    def prefill_tokens_while_decoding(self) -> int:
        """The flag, or the engine's (the server's) default (step_policy.py)."""
        return prefill_tokens_while_decoding(self.max_prefill_tokens_while_decoding, self.max_num_seqs,
                                             self.step_budget(), self.prefill_graph_tokens)

    def quantized(self, model: ModelConfig) -> ModelConfig:
        """The checkpoint's ModelConfig with --quantization applied: a dense checkpoint marked to be quantized
        at load; an FP8 checkpoint as it is (already FP8). Raises ConfigError where FP8 cannot run as asked."""
        if self.quantization == "fp8" and model.quantization is None:
            model = replace(model, quantization=WeightQuantization("fp8-at-load"))
        if model.quantization is not None and self.tensor_parallel_size > 1:
            raise ConfigError("FP8 weights with --tensor-parallel-size > 1 are not supported yet; run on one GPU "
                              "(an 8B model in FP8 fits one H200) or leave out --quantization")
        return model

    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size)

    def graph_config(self, device_is_cuda: bool) -> GraphConfig:
        if self.enforce_eager or not device_is_cuda:
            return GraphConfig(True, (), self.cuda_graph_fallback, self.skip_graph_check)
        sizes = plan_capture_sizes(self.max_num_seqs, self.cuda_graph_sizes, self.max_cuda_graph_size,
                                   decode_rows_per_sequence(speculative_config(self)))
        prefill = plan_prefill_graph_tokens(self.step_budget(), self.prefill_graph_tokens)
        warn_dropped_prefill_graph_tokens(self.prefill_graph_tokens, prefill, self.step_budget())
        return GraphConfig(False, sizes, self.cuda_graph_fallback, self.skip_graph_check, prefill,
                           min(self.prefill_graph_max_seqs, self.max_num_seqs), self.mixed_step)

    def resolve(self, model_dir: str | Path | None = None, device: str | None = None,
                draft_model_dir: str | Path | None = None) -> EngineConfig:
        """Check the flags against the checkpoint (its config.json is read here, once) and split them per component.

        model_dir: the HF folder `model` names (default `model` itself; model/gguf_sources.resolve_model_dir turns
        a GGUF file or short name into one). device: "cuda" or "cpu", what --device auto picked (default --device;
        config imports no torch, so the caller asks torch). draft_model_dir: the HF folder --speculative-model
        names, resolved the same way (default the flag itself)."""
        model_dir = str(model_dir if model_dir is not None else self.model)
        device = device or self.device
        if device not in ("cuda", "cpu"):
            raise ConfigError(f"EngineArgs.resolve needs the device --device {self.device} stands for: cuda or cpu")
        model = self.quantized(ModelConfig.from_dir(model_dir))
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if device == "cuda" else "torch"
        graph = self.graph_config(device == "cuda")
        if device == "cuda" and graph.prefill_sizes and backend != "triton":
            # The torch backend's prefill reads sequence lengths on the host: it cannot be captured.
            logger.info("prefill graphs off: --attention-backend %s reads lengths on the host (use triton)", backend)
            graph = replace(graph, prefill_sizes=())
        if self.batch_invariant and device == "cuda" and backend == "torch" and not graph.enforce_eager:
            raise ConfigError("--batch-invariant with --attention-backend torch attends row by row, reading lengths "
                              "on the host, which a CUDA graph cannot hold: use --attention-backend triton (or auto), "
                              "or add --enforce-eager")
        runner = RunnerConfig(
            model_dir=model_dir, model=model, scheduler=self.scheduler_config(model), graph=graph,
            kv_pool=KVPoolConfig(self.block_size, self.num_kv_blocks, self.gpu_memory_utilization, self.kv_cache_dtype),
            dtype=self.dtype, device=device, attention_backend=backend, pdl=self.pdl, seed=self.seed,
            decode_tuning=self.decode_tuning, batch_invariant=self.batch_invariant,
            speculative=resolve_speculative(self, model, draft_model_dir))
        defaults, source = read_generation_defaults(self.generation_config, model_dir)
        return EngineConfig(
            runner=runner, parallel=self.parallel_config(), model_source=self.model,
            tokenizer=self.tokenizer or model_dir,
            served_model_name=self.served_model_name or default_served_model_name(self.model),
            enable_prefix_caching=self.enable_prefix_caching, async_scheduling=self.async_scheduling,
            generation_defaults=defaults, generation_defaults_source=str(source) if source else None)
