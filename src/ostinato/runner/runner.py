"""ModelRunner: owns the model, the KV pool and the decode rows; turns a SchedulerOutput into sampled tokens.

Prefill runs eager; its sequences then join the persistent decode batch (runner/decode_batch.py). A decode
step applies the step's changes to the rows (left, new blocks), copies the rows to the device once, and
replays the graph of the smallest captured size >= batch (runner/graphs.py; eager, counted, above the largest
size or when graphs are off), which samples inside; then one device-to-host copy of the tokens.

The mixed step (decode rows + prefill chunks, chunked prefill). Two ways to run it:
(a) the decode rows as their usual graph replay, then the chunks as one eager forward, on the same stream;
(b) one eager forward over the rows' tokens and the chunks' tokens together.
We run (a). It keeps the decode contract whole: the rows stay the persistent DecodeBatch, their input tokens
stay placeholders resolved on the device, sampling stays inside the graph, overlapped scheduling goes on
through mixed steps (a chunk that does not end its prompt needs no host sync at all), and greedy output does
not depend on whether a prefill happened to run beside a decode. (b) saves one read of the weights per mixed
step (the chunk's GEMMs read them anyway): for llama-3.1-8b about 3.6 ms at 4.13 TB/s, against a replay of
~6-7 ms at batch 32, i.e. (a) costs roughly replay + chunk where (b) costs ~chunk. (b) would need the rows'
placeholder resolution and in-graph sampling rebuilt eagerly, and the decode attention of the rows run through
the prefill kernel. Under (a) the inter-token latency of running decodes during a long prefill is bounded by
replay + the chunk's forward, so --max-num-batched-tokens is the knob: `ostinato bench chunked` measures it
(tools/bench_prefill.py), and the same bench with `--max-num-batched-tokens` large enough for the whole
prompt shows what one unchunked prefill costs the decodes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ..attention.base import AttentionBackend
from ..config import CacheConfig, EngineArgs, GraphConfig, ModelConfig, SchedulerConfig
from ..contract import SampledToken, SchedulerOutput, StepResult
from ..errors import ConfigError
from ..model.loader import load_model, resolve_dtype, weights_nbytes
from ..model.parallel import SINGLE_RANK, TPGroup, rank_view
from .compile_watch import CompileWatch
from .decode_step import DecodeStep
from .inputs import build_prefill_inputs, decode_metadata
from .kv_setup import KVSpec, allocate_kv_and_graphs
from .sampler import Sampler, SamplerOutput, finish_sampling
from .warmup import warm_up_prefill

logger = logging.getLogger(__name__)

# The decode annotation `ostinato verify` reads step boundaries from, recorded only while a profiler runs.
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


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
    """One rank's runner. Under tensor parallelism (runner/tp_executor.py) every rank builds one with its
    `tp` place and runs every step; `agree_num_blocks` then makes the KV pool the smallest any rank fits."""

    def __init__(self, args: EngineArgs, model_config: ModelConfig, scheduler_config: SchedulerConfig,
                 tp: TPGroup = SINGLE_RANK, agree_num_blocks: Callable[[int], int] | None = None):
        self.args = args
        self.tp = tp
        if tp.world_size > 1:  # the start-up self-check draws random rows: the same ones on every rank
            torch.manual_seed(args.seed)
        self.model_config = model_config
        self.scheduler_config = scheduler_config
        self.device = pick_device(args.device)
        self.dtype = resolve_dtype(args.dtype, model_config, self.device)
        self.backend = make_backend(args.attention_backend, self.device)
        # Installed before anything compiles (capture included), sealed at the end of start-up: an earlier
        # engine's sealed watch in this process must not count this engine's start-up compiles.
        self.compile_watch = CompileWatch()
        if self.device.type == "cuda":
            self.compile_watch.install()
        self.block_size = args.block_size
        t0 = time.perf_counter()
        self.model = load_model(args.model, model_config, self.dtype, self.device, self.backend,
                                progress=tp.rank == 0, tp=tp)
        self.load_seconds = time.perf_counter() - t0
        self.weights_bytes = weights_nbytes(self.model)
        logger.info("loaded %s (%.2f GiB, %s) in %.1f s", args.model, self.weights_bytes / 2**30,
                    self.dtype, self.load_seconds)
        self.graph_config: GraphConfig = args.graph_config(self.device.type == "cuda")
        # Sizes the KV pool (profiling on GPU, charging graph memory) and captures the decode graphs.
        self.kv_spec = KVSpec(
            self.model, rank_view(model_config, tp.world_size), scheduler_config, self.graph_config, self.device,
            self.dtype, self.block_size, self.weights_bytes, args.num_kv_blocks, args.gpu_memory_utilization,
            make_step=lambda layout: DecodeStep(self.decode_logits, layout, self.device, args.seed),
            agree_num_blocks=agree_num_blocks, capture_error_mode="thread_local" if tp.world_size > 1 else "global")
        setup = allocate_kv_and_graphs(self.kv_spec)
        self.cache_config: CacheConfig = setup.cache_config
        self.kv_caches = setup.kv_caches
        self.graphs = setup.graph_runner
        self.decode_step = setup.decode_step
        self.decode_batch = setup.decode_step.batch
        # Pinned host memory for the step's tokens: the one device-to-host copy lands here.
        rows = self.decode_batch.layout.rows
        cuda = self.device.type == "cuda"
        self._tokens_host = [torch.zeros(rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._turn = 0
        self._sampled_np = self.decode_step.sampled.numpy() if not cuda else None
        self.capture_report = setup.capture
        self.memory_report = setup.report
        self.kv_plan = setup.plan
        self.scratch_block = self.cache_config.num_blocks
        self.sampler = Sampler(self.device, args.seed)
        if cuda:  # compile the eager prefill path's kernel variants now, not inside a user's step
            ran, seconds = warm_up_prefill(self.model, self.sampler, self.block_size, self.scratch_block,
                                           self.device, scheduler_config.max_model_len)
            logger.info("warmed the prefill path (%d steps, %d kernel compilations) in %.1f s", ran,
                        self.compile_watch.compiles_at_startup, seconds)
            self.compile_watch.seal()

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
        """One decode step up to the logits. [B] inputs -> [B, vocab] float32. Capturable.

        Float32 straight from the lm_head GEMM (compute_logits): bf16 logits tie at steps of 0.125 and
        greedy then flips on ties. It costs the graphs' shared static output 4 bytes per logit (131 MB for
        a 128k vocabulary at batch 256, not 65 MB)."""
        meta = decode_metadata(slot_mapping, block_tables, context_lens)
        hidden = self.model(input_ids, positions, meta)  # [B, hidden]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run a step and wait for its tokens."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> "PendingStep":
        """Run a step: its decode rows as one replay (launched, not waited for: its tokens are read by
        PendingStep.result(), which may come after the next step was launched, i.e. overlapped scheduling),
        then its prefill chunks eager (see the module docstring for why they run beside the replay)."""
        batch = self.decode_batch
        batch.apply(out.left, out.new_blocks)
        n = len(batch)
        assert n == out.num_decode, f"the scheduler decodes {out.num_decode} sequences, the runner holds {n}"
        pending = PendingStep(StepResult([], [], []))
        if n and _profiling():  # only then: the annotation costs a few microseconds per step
            with torch.profiler.record_function(f"ostinato.decode_step[{n}]"):
                pending = self._launch_decode(n)
                pending.result()  # inside the annotation: verify counts this step's launches
        elif n:
            pending = self._launch_decode(n)
        if out.seqs:  # after the replay: sequences that finish their prefill join rows past the n decoded
            pending.then(self._prefill(out))
        return pending

    def _prefill(self, out: SchedulerOutput) -> StepResult | None:
        """The step's prefill chunks in one eager forward; the chunks that end their prompt sample a token
        (a host sync) and join the decode batch. None when no chunk samples (no sync at all)."""
        inp = build_prefill_inputs(out, self.block_size, self.scratch_block, self.device)
        hidden = self.model(inp.input_ids, inp.positions, inp.meta)  # [T, hidden]
        seqs = [s for s in out.seqs if s.samples]
        if not seqs:
            return None
        logits = self.model.compute_logits(hidden[inp.last_token_indices])  # [num_sampled, vocab]
        sampled = self.sampler(logits, self.sampler.prepare(seqs))
        result = _result([s.seq_id for s in seqs], sampled)
        for seq, tok in zip(seqs, result.tokens):
            self.decode_batch.join(seq, tok.token_id)
        return result

    def _launch_decode(self, n: int) -> "PendingStep":
        batch, step = self.decode_batch, self.decode_step
        size = self.graphs.graph_size(n) or n
        rows = batch.copy_to_device(size)  # the step's one host-to-device copy
        logits = self.graphs.replay_filled(n)  # [n, vocab]; tokens sampled inside into step.sampled
        seq_ids = list(batch.rows.seq_ids)
        batch.advance(n)  # next step: one position on, feeding placeholders for these tokens
        if batch.needs_finish:  # top-k / top-p rows, or logprobs asked: eager work on the static logits
            # A clone, not a view: the next step's replay overwrites step.sampled before these are read.
            sampled = finish_sampling(logits, step.sampled[:n].clone(), batch.sampling(rows[:n]))
            step.sampled[:n].copy_(sampled.token_ids)  # the next step's placeholders read the final tokens
            return PendingStep(seq_ids=seq_ids, sampled=sampled)
        if self._sampled_np is not None:  # CPU: the step ran, its tokens are in host memory already
            return PendingStep(_plain(seq_ids, self._sampled_np[:n].tolist()))
        # The one device-to-host copy, into pinned memory used every other step: the step before may
        # still be unread while this one is launched.
        self._turn ^= 1
        host, event = self._tokens_host[self._turn], self._events[self._turn]
        host[:n].copy_(step.sampled[:n], non_blocking=True)
        event.record()
        return PendingStep(seq_ids=seq_ids, host=host[:n], event=event)


class PendingStep:
    """A launched step; result() waits for its tokens (once) and returns them: the decode rows', then those of
    the prefill chunks that sampled in the same step (`then`)."""

    def __init__(self, done: StepResult | None = None, seq_ids: list[int] | None = None,
                 sampled: SamplerOutput | None = None, host: torch.Tensor | None = None, event=None):
        self._done, self._seq_ids, self._sampled, self._host, self._event = done, seq_ids, sampled, host, event
        self._then: StepResult | None = None

    def then(self, chunks: StepResult | None) -> None:
        """Append the tokens of the step's prefill chunks (known already: their sampling synced)."""
        if chunks is None:
            return
        if self._done is not None:  # read already (profiling): append now
            self._done = _concat(self._done, chunks)
        else:
            self._then = chunks

    @property
    def seq_ids(self) -> list[int]:
        ids = self._done.seq_ids if self._done is not None else self._seq_ids
        return ids + self._then.seq_ids if self._then is not None else ids

    def result(self) -> StepResult:
        if self._done is None:
            if self._sampled is not None:
                self._done = _result(self._seq_ids, self._sampled)
            else:
                self._event.synchronize()
                self._done = _plain(self._seq_ids, self._host.tolist())
            if self._then is not None:
                self._done, self._then = _concat(self._done, self._then), None
        return self._done


def _concat(a: StepResult, b: StepResult) -> StepResult:
    return StepResult(a.seq_ids + b.seq_ids, a.token_ids + b.token_ids, a.tokens + b.tokens)


def _plain(seq_ids: list[int], token_ids: list[int]) -> StepResult:
    return StepResult(seq_ids, token_ids, list(map(SampledToken, token_ids)))


def _result(seq_ids: list[int], sampled: SamplerOutput) -> StepResult:
    host = sampled.to_host()  # the step's one host sync
    if host.logprobs is None:
        return _plain(seq_ids, host.token_ids)
    return StepResult(seq_ids, host.token_ids, [
        SampledToken(token_id=host.token_ids[i], logprob=host.logprobs[i],
                     top=None if host.top_ids is None else list(zip(host.top_ids[i], host.top_logprobs[i])))
        for i in range(len(seq_ids))
    ])
