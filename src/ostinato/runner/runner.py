"""ModelRunner: owns the model, the KV pool and the decode rows; turns a SchedulerOutput into sampled tokens.

Prefill runs as a prefill-graph replay when it fits one, else eager (below); its sequences then join the
persistent decode batch (runner/decode_batch.py). A decode step applies the step's changes to the rows (left,
new blocks), copies the rows to the device once, and replays the graph of the smallest captured size >= batch
(runner/graphs.py; eager, counted, above the largest size or when graphs are off), which samples inside; then
one device-to-host copy of the tokens.

The mixed step (decode rows + prefill chunks, chunked prefill). Two ways to run it (--mixed-step):
(b) "one-replay" (default): the decode rows ride first in the chunks' prefill-graph replay, one token each
    (runner/prefill_graphs.py run_mixed): the weights are read once for both. The rows keep the decode
    contract: their input tokens are the persistent DecodeBatch's (placeholders resolved inside the graph),
    the decode kernel attends them (AttentionBackend.attend: the prefill kernels never see them, so their
    grids do not grow with the batch), and their tokens come from the decode graph's own sampling code on
    the same settings, so a seed gives the same tokens whichever way a step ran. Used when the step's decode
    rows + chunk tokens fit a captured prefill token count (--prefill-graph-tokens, up to 512 by default).
(a) "two-replays", and any mixed step too large for (b): the decode rows as their usual decode replay, then
    the chunks as a prefill replay (or eager above the largest captured count), on the same stream.
Why (b) is the default (`ostinato bench chunked`; docs/PERFORMANCE.md, "Why these defaults"): (a) pays a
second read of the weights and the chunk's own GEMMs on top of the decode replay, so beside a long prompt the
decodes' inter-token gap grows far more than under (b). Either way no chunk waits for the host (one that ends its
prompt has its token read with the step's: _sample_chunks), so overlapped scheduling goes on through mixed
steps. --max-num-batched-tokens is the knob between that gap and the long prompt's time to first token.

Prefill chunks run as a CUDA-graph replay when the step's tokens fit a captured count (the smallest of
--prefill-graph-tokens >= its tokens, at most --prefill-graph-max-seqs sequences; padded tokens write only
the scratch block). An eager forward of a large model costs about as much host time in launches up to ~500
tokens whatever its GPU work, which is what stalled the decodes; a replay costs its GPU work. Larger
steps run eager (the GPU work dominates there), counted in the prefill step stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from ostinato.config import CacheConfig, GraphConfig, RunnerConfig, quantization_label
from ostinato.contract import ScheduledSeq, SchedulerOutput, StepResult
from ostinato.model.loader import load_model, resolve_dtype, weights_nbytes
from ostinato.model.parallel import SINGLE_RANK, TPGroup, rank_view
from ostinato.runner.backends import make_backend, pdl_status, pick_device  # noqa: F401 - re-exported
from ostinato.runner.compile_watch import CompileWatch
from ostinato.runner.decode_step import DecodeStep
from ostinato.runner.draft import DraftModel, draft_block_bytes
from ostinato.runner.sampling_state import FLAGS
from ostinato.runner.inputs import build_prefill_inputs, decode_metadata, to_device
from ostinato.runner.kv_setup import KV_CACHE_TORCH_DTYPES, KVSpec, allocate_kv_and_graphs, estimate_graph_bytes
from ostinato.runner.pending import ChunkSamples, PendingStep, plain_result
from ostinato.runner.sampler import Sampler, finish_sampling
from ostinato.runner.spec_verify import SpecVerifier
from ostinato.runner.structured import GrammarMasks, constrain_decode, mask_logits
from ostinato.runner.warmup import warm_up_prefill

logger = logging.getLogger(__name__)

# The decode annotation `ostinato verify` reads step boundaries from, recorded only while a profiler runs.
_profiling = getattr(torch._C._autograd, "_profiler_enabled", lambda: True)


class ModelRunner:
    """One rank's runner. Under tensor parallelism (runner/tp_executor.py) every rank builds one with its
    `tp` place and runs every step; `agree_num_blocks` then makes the KV pool the smallest any rank fits."""

    def __init__(self, config: RunnerConfig, tp: TPGroup = SINGLE_RANK,
                 agree_num_blocks: Callable[[int], int] | None = None):
        self.config = config
        self.tp = tp
        if tp.world_size > 1:  # the start-up self-check draws random rows: the same ones on every rank
            torch.manual_seed(config.seed)
        self.model_config = config.model
        self.scheduler_config = config.scheduler
        self.graph_config: GraphConfig = config.graph
        self.device = pick_device(config.device)
        self.dtype = resolve_dtype(config.dtype, config.model, self.device)
        self.backend = make_backend(config.attention_backend, self.device, config.pdl, config.decode_tuning,
                                    config.batch_invariant, verify_rows=config.speculative is not None)
        if config.batch_invariant:
            logger.info("batch-invariant mode on: a request's tokens do not depend on its batch "
                        "(docs/ARCHITECTURE.md, \"Batch-invariant mode\")")
        # Installed before anything compiles (capture included), sealed at the end of start-up: an earlier
        # engine's sealed watch in this process must not count this engine's start-up compiles.
        self.compile_watch = CompileWatch()
        if self.device.type == "cuda":
            self.compile_watch.install()
        self.block_size = config.kv_pool.block_size
        self._load_model()
        self.draft = None  # --speculative-method draft: the draft model (runner/draft.py), once its pool exists
        # Loaded before the KV pool is sized, so that its weights count as memory in use.
        self._draft_model = self._load_draft_model()
        self._allocate_kv_and_graphs(agree_num_blocks)
        # Pinned host memory for the step's tokens: the one device-to-host copy lands here.
        rows = self.decode_batch.layout.rows
        cuda = self.device.type == "cuda"
        self._tokens_host = [torch.zeros(rows, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._turn = 0
        self._sampled_np = self.decode_step.sampled.numpy() if not cuda else None
        self.sampler = Sampler(self.device, config.seed, config.batch_invariant)
        # Speculative decoding: every step is a verify step (runner/spec_verify.py).
        if self._draft_model is not None:
            self.draft = DraftModel(self._draft_model, config.speculative.draft_model, self.cache_config.num_blocks,
                                    self.block_size, self.dtype, self.device, config.seed)
            if self.prefill_graphs is not None and self.prefill_graphs.enabled:
                self.draft.capture_graphs(self.kv_spec, self._graph_backend)
        self.verifier = None if config.speculative is None else SpecVerifier(
            self.model, self.prefill_graphs, self.block_size, self.scratch_block, self.device, config.seed,
            drafter=self.draft, decode_step=self.decode_step, decode_graphs=self.graphs)
        if cuda:
            self._warm_up()

    def _load_model(self) -> None:
        logger.info("loading weights from %s", self.config.model_dir)
        t0 = time.perf_counter()
        self.model = load_model(self.config.model_dir, self.model_config, self.dtype, self.device, self.backend,
                                progress=self.tp.rank == 0, tp=self.tp,
                                fp8_kv_cache=self.config.kv_pool.cache_dtype != "auto")
        self.load_seconds = time.perf_counter() - t0
        self.weights_bytes = weights_nbytes(self.model)
        logger.info("loaded %s (%.2f GiB, %s, weights %s) in %.1f s", self.config.model_dir,
                    self.weights_bytes / 2**30, self.dtype, quantization_label(self.model_config.quantization),
                    self.load_seconds)

    def _load_draft_model(self) -> torch.nn.Module | None:
        spec = self.config.speculative
        if spec is None or not spec.uses_draft_model:
            return None
        logger.info("loading the draft model from %s", spec.draft_model_dir)
        config = self.config
        backend = make_backend(config.attention_backend, self.device, config.pdl, config.decode_tuning)
        return load_model(spec.draft_model_dir, spec.draft_model, self.dtype, self.device, backend, progress=False)

    def _allocate_kv_and_graphs(self, agree_num_blocks: Callable[[int], int] | None) -> None:
        """Sizes the KV pool (profiling on GPU, charging graph memory) and captures the decode graphs."""
        config, tp = self.config, self.tp
        self.kv_spec = KVSpec(
            self.model, rank_view(config.model, tp.world_size), config.scheduler, self.graph_config, self.device,
            self.dtype, self.block_size, self.weights_bytes, config.kv_pool.num_blocks,
            config.kv_pool.gpu_memory_utilization,
            make_step=lambda layout: DecodeStep(self.decode_logits, layout, self.device, config.seed,
                                                config.model.vocab_size, config.batch_invariant),
            agree_num_blocks=agree_num_blocks, capture_error_mode="thread_local" if tp.world_size > 1 else "global",
            compile_watch=self.compile_watch,
            extra_block_bytes=0 if self._draft_model is None else draft_block_bytes(
                config.speculative.draft_model, self.block_size, self.dtype),
            cache_dtype=KV_CACHE_TORCH_DTYPES[config.kv_pool.cache_dtype])
        setup = allocate_kv_and_graphs(self.kv_spec)
        self._graph_backend = setup.graph_backend
        self.cache_config: CacheConfig = setup.cache_config
        self.kv_caches = setup.kv_caches
        self.graphs = setup.graph_runner
        self.processor_graphs = setup.processor_graphs  # the same step with the logits processors (decode_step.py)
        self.decode_step = setup.decode_step
        self.decode_batch = setup.decode_step.batch
        self.prefill_graphs = setup.prefill_graphs  # prefill chunks as replays (runner/prefill_graphs.py)
        self.prefill_capture_report = setup.prefill_capture
        self.capture_report, self.processor_capture_report = setup.capture, setup.processor_capture
        self.memory_report = setup.report
        self.kv_plan = setup.plan
        self.scratch_block = self.cache_config.num_blocks

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV pool's element type (--kv-cache-dtype; the model's dtype by default)."""
        return self.kv_spec.kv_dtype

    def _warm_up(self) -> None:
        """Compile the eager prefill path's kernel variants now, not inside a user's step."""
        logger.info("decoder kernels: %s (%s)", self.model.kernels.name,
                    pdl_status(self.config.pdl, self.backend.pdl, self.device))
        scheduler = self.scheduler_config
        ran, seconds = warm_up_prefill(self.model, self.sampler, self.block_size, self.scratch_block,
                                       self.device, scheduler.max_model_len, max_sampled_rows=scheduler.max_num_seqs)
        if self.draft is not None:  # the draft's steps take the eager prefill path's kernels at its shapes
            ran_draft, seconds_draft = warm_up_prefill(self.draft.model, self.sampler, self.block_size,
                                                       self.scratch_block, self.device, scheduler.max_model_len,
                                                       max_sampled_rows=scheduler.max_num_seqs)
            ran, seconds = ran + ran_draft, seconds + seconds_draft
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
        """Every graph's memory: decode and prefill."""
        return (self.capture_report.total_bytes + self.processor_capture_report.total_bytes
                + self.prefill_graph_memory_bytes)

    @property
    def prefill_graph_memory_bytes(self) -> int:
        return self.prefill_capture_report.total_bytes

    @property
    def graph_capture_seconds(self) -> float:
        return self.capture_report.seconds + self.processor_capture_report.seconds + self.prefill_capture_report.seconds

    def graph_stats(self):
        return self.graphs.stats.combined(self.processor_graphs.stats)

    def step_graphs(self):
        """The decode graph set the rows' next step replays: with the logits processors only while some row uses one."""
        return self.processor_graphs if self.decode_batch.uses_processors else self.graphs

    def prefill_graph_stats(self):
        return self.prefill_graphs.stats()

    # ---- the rest of the Runner protocol (runner/protocol.py), for one rank -----------------------------
    def call_all(self, target: str, *args):
        """Run `target` ("module:function", taking the runner first) here: this is the only rank."""
        from ostinato.runner.tp_worker import resolve_call

        with torch.inference_mode():  # as the tensor-parallel runner runs it on every rank
            return resolve_call(target)(self, *args)

    def probe_decode_graph_bytes(self, size: int) -> int:
        """Bytes a decode graph of `size` rows adds when captured alone, measured by capturing it into a
        throwaway pool over a temporary KV pool (`ostinato advise` weighs graph memory this way). The model is
        left bound to a pool of the scratch block alone: rebind self.kv_caches after the last probe."""
        # The decode graphs' own backend (its capture stream): what a capture stream costs once is not counted twice.
        return estimate_graph_bytes(self.kv_spec, size, self.graphs._backend)

    def rank_health(self) -> list[dict]:
        return []  # one rank: nothing to report beside the engine's own health

    def shutdown(self) -> None:
        """Nothing to stop: a single rank starts no processes."""

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
    def launch(self, out: SchedulerOutput, masks: GrammarMasks | None = None) -> PendingStep:
        """Run a step (launched, not waited for: its tokens are read by PendingStep.result(), which may come
        after the next step was launched, i.e. overlapped scheduling). A mixed step runs as one prefill-graph
        replay when it fits one (design (b)), else as the decode replay and then the chunks (design (a)); see
        the module docstring. `masks`: the grammar masks of the constrained rows (runner/structured.py), asked
        for once the forward is launched; None when no running sequence is constrained."""
        if self.verifier is not None:
            return self.verifier.launch(out)
        batch = self.decode_batch
        batch.apply(out.left, out.new_blocks)
        n = len(batch)
        assert n == out.num_decode, f"the scheduler decodes {out.num_decode} sequences, the runner holds {n}"
        size = self.prefill_graphs.size_for(out, decode_rows=n) if n and out.seqs else None
        if size is not None:
            if _profiling():  # a step of its own kind: `verify` counts the launches of decode steps
                with torch.profiler.record_function(f"ostinato.mixed_step[{n}]"):
                    return self._launch_mixed(out, n, size, masks)
            return self._launch_mixed(out, n, size, masks)
        pending = PendingStep(StepResult([], [], []))
        if n and _profiling():  # only then: the annotation costs a few microseconds per step
            with torch.profiler.record_function(f"ostinato.decode_step[{n}]"):
                pending = self._launch_decode(n, masks)
                pending.result()  # inside the annotation: verify counts this step's launches
        elif n:
            pending = self._launch_decode(n, masks)
        if out.seqs:  # after the replay: sequences that finish their prefill join rows past the n decoded
            pending.then(self._prefill(out, masks))
        return pending

    def _prefill(self, out: SchedulerOutput, masks: GrammarMasks | None) -> ChunkSamples | None:
        """The step's prefill chunks in one forward: a graph replay when they fit a captured token count
        (runner/prefill_graphs.py), else eager (counted). None when no chunk samples."""
        replayed = self.prefill_graphs.run(out)
        if replayed is not None:
            hidden, last_rows = replayed  # [n, hidden], a view into the graph's static output
        else:
            inp = build_prefill_inputs(out, self.block_size, self.scratch_block, self.device)
            hidden = self.model(inp.input_ids, inp.positions, inp.meta)  # [T, hidden]
        seqs = [s for s in out.seqs if s.samples]
        if not seqs:
            return None
        last_token_indices = inp.last_token_indices if replayed is None else \
            to_device(last_rows, torch.int64, self.device)
        return self._sample_chunks(seqs, self.model.compute_logits(hidden[last_token_indices]), masks)

    def _sample_chunks(self, seqs: list[ScheduledSeq], logits: torch.Tensor, masks: GrammarMasks | None
                       ) -> ChunkSamples:
        """Sample the chunks that end their prompt (logits [len(seqs), vocab]); they join the decode batch.

        No host sync here: the sampled tokens go to the host like the decode rows' (read by
        PendingStep.result(), after the next step was launched), and each new row feeds a placeholder for its
        token, copied into the decode step's `sampled` buffer on the device. Waiting here instead made the
        step that ends a long prompt wait for two steps of GPU work (~42 ms at 8B, 32 decodes, 256-token
        chunks: `bench chunked`), one whole gap for every running stream."""
        rows = [self.decode_batch.join(seq) for seq in seqs]  # appended: consecutive rows
        assert rows == list(range(rows[0], rows[0] + len(rows))), rows
        if masks is not None:  # a constrained sequence's first token follows its grammar too
            mask_logits(logits, [s.seq_id for s in seqs], masks)
        # Drawn from the settings the rows now hold: one state for a sequence's prefill and decode draws.
        batch = self.decode_batch.joined_sampling(rows[0], len(rows))
        if self.decode_batch.np[rows[0]:rows[0] + len(rows), FLAGS].any():  # their logit_bias, penalties, ...
            self.decode_step.processors.process_logits(logits, batch.rows)
        sampled = self.sampler(logits, batch)
        self.decode_step.sampled[rows[0]:rows[0] + len(rows)].copy_(sampled.token_ids)  # their placeholders
        return ChunkSamples([s.seq_id for s in seqs], sampled.to_host_async())

    def _launch_mixed(self, out: SchedulerOutput, n: int, size: int, masks: GrammarMasks | None) -> PendingStep:
        """Design (b): the n decode rows ride first in the chunks' prefill-graph replay, so a mixed step reads
        the weights once. The rows keep their contract: their input tokens are the rows' own (placeholders
        resolved in the graph), the decode kernel attends them, and their tokens are drawn by the decode
        graph's sampling code on the same settings (then the same finishing and host copy), so a seed gives
        the same tokens whichever way a step ran."""
        batch, step = self.decode_batch, self.decode_step
        rows = batch.copy_to_device(n)  # their sampling settings (tokens and positions go in fill's buffers)
        hidden, last_rows = self.prefill_graphs.run_mixed(out, batch.np[:n], size)
        seqs = [s for s in out.seqs if s.samples]
        index = to_device(list(range(n)) + last_rows, torch.int64, self.device)
        logits = self.model.compute_logits(hidden[index])  # [n + len(seqs), vocab]
        step.sample(logits[:n], rows, batch.uses_processors)
        pending = self._decode_tokens(n, rows, logits[:n], masks)
        if seqs:
            pending.then(self._sample_chunks(seqs, logits[n:], masks))
        return pending

    def _launch_decode(self, n: int, masks: GrammarMasks | None) -> PendingStep:
        graphs = self.step_graphs()
        size = graphs.graph_size(n) or n
        rows = self.decode_batch.copy_to_device(size)  # the step's one host-to-device copy
        logits = graphs.replay_filled(n)  # [n, vocab]; tokens sampled inside into step.sampled
        return self._decode_tokens(n, rows, logits, masks)

    def _decode_tokens(self, n: int, rows: torch.Tensor, logits: torch.Tensor, masks: GrammarMasks | None
                       ) -> PendingStep:
        """The decode rows' tokens are in step.sampled[:n] (logits [n, vocab]): finish the sampling where
        asked, advance the rows, and start the tokens' way to the host."""
        batch, step = self.decode_batch, self.decode_step
        seq_ids = list(batch.rows.seq_ids)
        if masks is not None:  # constrained rows: masked and drawn again, eagerly after the replay
            constrain_decode(logits, rows, step.sampled[:n], seq_ids, masks, self.config.batch_invariant)
        sampled = None
        if batch.needs_finish:  # top-k / top-p rows, or logprobs asked: eager work on the static logits
            # Before advance: the re-draw reads the rows' counters, and on a CPU the device rows are the host
            # rows advance moves on, so after it a top-k / top-p row would draw with its next token's counter.
            # A clone, not a view: the next step's replay overwrites step.sampled before these are read.
            sampled = finish_sampling(logits, step.sampled[:n].clone(), batch.sampling(rows[:n]))
        batch.advance(n)  # next step: one position on, feeding placeholders for these tokens
        if sampled is not None:
            step.sampled[:n].copy_(sampled.token_ids)  # the next step's placeholders read the final tokens
            return PendingStep(seq_ids=seq_ids, sampled=sampled)
        if self._sampled_np is not None:  # CPU: the step ran, its tokens are in host memory already
            return PendingStep(plain_result(seq_ids, self._sampled_np[:n].tolist()))
        # The one device-to-host copy, into pinned memory used every other step: the step before may
        # still be unread while this one is launched.
        self._turn ^= 1
        host, event = self._tokens_host[self._turn], self._events[self._turn]
        host[:n].copy_(step.sampled[:n], non_blocking=True)
        event.record()
        return PendingStep(seq_ids=seq_ids, host=host[:n], event=event)
