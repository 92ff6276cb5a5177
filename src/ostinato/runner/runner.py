"""ModelRunner: owns the model, the KV pool and the sampler; turns a SchedulerOutput into sampled tokens.

Prefill runs eager. Decode goes through the CudaGraphRunner (runner/graphs.py), which replays the graph of the
smallest captured size >= batch and runs eager (counted) above the largest size or when graphs are off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..attention.base import AttentionBackend
from ..config import CacheConfig, EngineArgs, GraphConfig, ModelConfig, SchedulerConfig
from ..engine.request import SchedulerOutput
from ..errors import ConfigError
from ..model.loader import load_model, resolve_dtype, weights_nbytes
from .inputs import build_decode_inputs, build_prefill_inputs, decode_metadata
from .sampler import Sampler

logger = logging.getLogger(__name__)


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA GPU; use --device cpu")
    return torch.device(name)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "triton":
        if device.type != "cuda":
            raise ConfigError("--attention-backend triton needs a CUDA device; use --attention-backend torch")
        from ..attention.triton_paged import TritonPagedBackend

        return TritonPagedBackend()
    from ..attention.torch_ref import TorchRefBackend

    return TorchRefBackend()


class ModelRunner:
    def __init__(self, args: EngineArgs, model_config: ModelConfig, scheduler_config: SchedulerConfig):
        self.args = args
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.device = pick_device(args.device)
        self.dtype = resolve_dtype(args.dtype, model_config, self.device)
        self.backend = make_backend(args.attention_backend, self.device)
        self.block_size = args.block_size
        t0 = time.perf_counter()
        self.model = load_model(args.model, model_config, self.dtype, self.device, self.backend)
        self.load_seconds = time.perf_counter() - t0
        self.weights_bytes = weights_nbytes(self.model)
        logger.info("loaded %s (%.2f GiB, %s) in %.1f s", args.model, self.weights_bytes / 2**30,
                    self.dtype, self.load_seconds)
        self.graph_config: GraphConfig = args.graph_config(self.device.type == "cuda")
        from .kv_setup import allocate_kv_and_graphs

        # Sizes the KV pool (profiling on GPU, charging graph memory) and captures the decode graphs.
        setup = allocate_kv_and_graphs(self)
        self.cache_config: CacheConfig = setup.cache_config
        self.kv_caches = setup.kv_caches
        self.graphs = setup.graph_runner
        self.capture_report = setup.capture
        self.memory_report = setup.report
        self.kv_plan = setup.plan
        self.scratch_block = self.cache_config.num_blocks
        self.sampler = Sampler(self.device, args.seed)

    # ---- graph state, as the engine reports it ------------------------------------------------------
    @property
    def graphs_enabled(self) -> bool:
        return self.graphs.graphs_enabled and bool(self.graphs.captured_sizes)

    @property
    def graph_disabled_cause(self) -> str | None:
        if self.graph_config.enforce_eager:
            return "--enforce-eager" if self.device.type == "cuda" else "no CUDA device (eager on CPU)"
        return self.graphs.disabled_cause

    @property
    def graph_status(self) -> str:
        if self.graphs_enabled:
            sizes = self.captured_sizes
            return f"active ({len(sizes)} sizes, {sizes[0]}..{sizes[-1]})"
        return f"disabled ({self.graph_disabled_cause})"

    @property
    def captured_sizes(self) -> tuple[int, ...]:
        return self.graphs.captured_sizes

    @property
    def graph_memory_bytes(self) -> int:
        return self.capture_report.total_bytes

    @property
    def graph_capture_seconds(self) -> float:
        return self.capture_report.seconds

    def graph_stats(self):
        return self.graphs.stats

    # ---- decode callable shared by graph capture, replay and the eager path -------------------------
    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """One decode step up to the logits. [B] inputs -> [B, vocab] in the model dtype. Capturable.

        The logits stay in the model dtype: the graphs' shared static output is then 2 bytes per logit
        (65 MB for a 128k vocabulary at batch 256, not 131 MB), and the float32 copy the sampler needs is
        made outside the graph."""
        meta = decode_metadata(slot_mapping, block_tables, context_lens)
        hidden = self.model(input_ids, positions, meta)  # [B, hidden]
        return self.model.compute_logits(hidden, float32=False)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        if out.kind == "prefill":
            inp = build_prefill_inputs(out, self.block_size, self.scratch_block, self.device)
            hidden = self.model(inp.input_ids, inp.positions, inp.meta)  # [T, hidden]
            logits = self.model.compute_logits(hidden[inp.last_token_indices])  # [num_seqs, vocab]
            return self._sample(out, logits)
        if out.kind == "decode":
            # The annotation lets `ostinato verify` attribute launches to decode steps in a profiler trace.
            with torch.profiler.record_function(f"ostinato.decode_step[{len(out.seqs)}]"):
                inp = build_decode_inputs(out, self.block_size, self.scratch_block, self.device)
                logits = self.graphs.run(**inp.as_dict()).float()  # [B, vocab]
                return self._sample(out, logits)
        return []

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> list[SampledToken]:
        batch = self.sampler.prepare(out.seqs)
        sampled = self.sampler(logits, batch).to_host()  # the step's one host sync
        return [
            SampledToken(
                token_id=sampled.token_ids[i],
                logprob=None if sampled.logprobs is None else sampled.logprobs[i],
                top=None if sampled.top_ids is None else list(zip(sampled.top_ids[i], sampled.top_logprobs[i])),
            )
            for i in range(len(out.seqs))
        ]
