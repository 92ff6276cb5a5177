"""Start-up: size the KV pool, allocate it, capture the decode graphs, and report what graphs cost.

On a GPU: start compiling the decode graphs' kernels (runner/compile_ahead.py), profile a worst-case prefill for
the activation peak meanwhile, capture the largest decode size once into a throwaway pool to estimate graph memory,
give the KV pool what is left of the budget (runner/memory.py), then capture every size for real and report measured
graph memory in KV blocks. On CPU, or with --num-kv-blocks, the pool size is given and no graphs are captured.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ostinato.config import CacheConfig, GraphConfig, ModelConfig, SchedulerConfig
from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.errors import CudaGraphCaptureError
from ostinato.sampling_params import SamplingParams
from ostinato.runner.compile_ahead import RunningPass, start_graph_kernel_compiles
from ostinato.runner.compile_watch import CompileWatch
from ostinato.runner.decode_batch import DecodeLayout
from ostinato.runner.decode_graph_check import check_decode_graphs
from ostinato.runner.decode_step import DecodeStep, processor_sizes
from ostinato.runner.logits_processors import state_bytes
from ostinato.runner.graphs import CaptureReport, CudaGraphBackend, CudaGraphRunner
from ostinato.runner.inputs import build_prefill_inputs
from ostinato.runner.memory import KVCachePlan, graph_memory_report, kv_block_bytes, plan_kv_cache
from ostinato.runner.prefill_graph_check import check_prefill_graphs
from ostinato.runner.prefill_graphs import PrefillGraphs

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30  # default KV pool on CPU when --num-kv-blocks is not given


# --kv-cache-dtype (config_readers.read_kv_cache_dtype) as the pool's element type; None: the model's dtype.
KV_CACHE_TORCH_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class KVSpec:
    """What start-up needs from the runner, passed explicitly (kv_setup does not import the runner)."""

    model: torch.nn.Module  # forward, compute_logits, bind_kv_caches
    model_config: ModelConfig
    scheduler_config: SchedulerConfig
    graph_config: GraphConfig
    device: torch.device
    dtype: torch.dtype
    block_size: int
    weights_bytes: int
    num_kv_blocks: int | None  # --num-kv-blocks, or None to size from memory
    gpu_memory_utilization: float
    make_step: Callable[[DecodeLayout], DecodeStep]  # the decode step over a KV pool's layout
    # Tensor parallelism: every rank's pool must hold the same blocks; this returns the smallest count any
    # rank can hold (a collective, called once by every rank). None for a single rank.
    agree_num_blocks: Callable[[int], int] | None = None
    # "thread_local" under tensor parallelism: NCCL's watchdog thread queries events while this thread
    # captures, which the global mode would count as an error; a host sync in the step still fails capture.
    capture_error_mode: str = "global"
    compile_watch: CompileWatch | None = None  # names a Triton compile that broke a capture (graph_backends.py)
    # Bytes per block of another KV pool allocated beside this one under the same block ids (the speculative
    # draft model's, runner/draft.py): the budget pays for both.
    extra_block_bytes: int = 0
    cache_dtype: torch.dtype | None = None  # the pool's element type (--kv-cache-dtype); None: `dtype`

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache_dtype or self.dtype


@dataclass
class KVSetup:
    cache_config: CacheConfig
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    graph_runner: CudaGraphRunner
    decode_step: DecodeStep
    capture: CaptureReport
    processor_graphs: CudaGraphRunner  # the decode step with the logits processors (decode_step.py)
    processor_capture: CaptureReport
    report: str  # the start-up memory report, already logged
    plan: KVCachePlan | None  # the GPU budget split; None when the pool size was given (CPU, --num-kv-blocks)
    prefill_graphs: PrefillGraphs | None = None
    prefill_capture: CaptureReport | None = None
    graph_backend: CudaGraphBackend | None = None  # what captured the graphs (None: none captured)


def allocate_kv_cache(spec: KVSpec, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks + 1, block_size, num_kv_heads, head_dim]; the extra block is
    the scratch block padded rows use. Zeroed so that reads of never-written slots stay finite."""
    mc = spec.model_config
    pool = torch.zeros(mc.num_layers, 2, num_blocks + 1, spec.block_size, mc.num_kv_heads, mc.head_dim,
                       dtype=spec.kv_dtype, device=spec.device)
    caches = [(pool[i, 0], pool[i, 1]) for i in range(mc.num_layers)]
    spec.model.bind_kv_caches(caches)
    return caches


@contextlib.contextmanager
def temporary_kv_pool(spec: KVSpec, num_blocks: int) -> Iterator[None]:
    """A KV pool of num_blocks blocks bound to the model while a probe runs. On exit the model lets go of it (it
    is bound to a pool of the scratch block alone), so its memory is free for what is measured or allocated next:
    the model's attention layers hold the pool, so dropping the caller's reference alone would keep it."""
    allocate_kv_cache(spec, num_blocks)
    try:
        yield
    finally:
        allocate_kv_cache(spec, 0)


def max_blocks_per_seq(spec: KVSpec) -> int:
    return math.ceil(spec.scheduler_config.max_model_len / spec.block_size)


def decode_layout(spec: KVSpec, num_blocks: int, sizes: tuple[int, ...]) -> DecodeLayout:
    """Rows for every running sequence (and the largest graph); pad rows use the scratch block num_blocks."""
    rows = max(spec.scheduler_config.max_num_seqs, max(sizes, default=0))
    return DecodeLayout(rows, max_blocks_per_seq(spec), spec.block_size, scratch_block=num_blocks)


def make_graph_runner(spec: KVSpec, num_blocks: int, sizes: tuple[int, ...], enforce_eager: bool,
                      fallback: str, progress: bool, backend: CudaGraphBackend | None = None
                      ) -> tuple[DecodeStep, CudaGraphRunner, CudaGraphRunner]:
    """The decode step and its two graph sets, without and with the logits processors, in one memory pool."""
    step = spec.make_step(decode_layout(spec, num_blocks, sizes))
    pool = backend.new_pool() if backend is not None and not enforce_eager and sizes else None
    plain = step.graph_runner(sizes, enforce_eager, fallback, progress, backend, pool=pool)
    with_processors = step.graph_runner(processor_sizes(sizes) if sizes else sizes, enforce_eager, fallback,
                                        progress, backend, processors=True, pool=pool)
    return step, plain, with_processors


def capture_both(spec: KVSpec, plain: CudaGraphRunner, with_processors: CudaGraphRunner, lines: list[str]
                 ) -> tuple[CaptureReport, CaptureReport]:
    """Capture the graphs without the logits processors, then those with them into the same static output."""
    capture = capture_decode_graphs(spec, plain, lines)
    if plain.graphs_enabled:
        with_processors.share_output_of(plain)
    return capture, capture_decode_graphs(spec, with_processors, lines)


def make_prefill_graphs(spec: KVSpec, num_blocks: int, sizes: tuple[int, ...], progress: bool,
                        backend: CudaGraphBackend | None, sampled: torch.Tensor | None = None) -> PrefillGraphs:
    """Prefill graphs over a pool of num_blocks (+ the scratch block); sizes () or --enforce-eager: none.
    With --mixed-step one-replay they carry up to max-num-seqs decode rows too (sampled: the decode step's
    sampled-token buffer their placeholders read)."""
    gc_cfg = spec.graph_config
    decode_rows = spec.scheduler_config.max_num_seqs if gc_cfg.mixed_step == "one-replay" else 0
    return PrefillGraphs(spec.model, sizes, max(1, gc_cfg.prefill_max_seqs), max_blocks_per_seq(spec),
                         spec.block_size, num_blocks, spec.scheduler_config.max_model_len, spec.device,
                         fallback=gc_cfg.fallback, enforce_eager=gc_cfg.enforce_eager or not sizes,
                         progress=progress, backend=backend, decode_rows=decode_rows, sampled=sampled)


def _estimate_prefill_graph_bytes(spec: KVSpec, backend: CudaGraphBackend) -> int:
    """Capture the largest prefill size once into a throwaway pool over a small temporary KV pool."""
    tmp_blocks = max_blocks_per_seq(spec)
    try:
        with temporary_kv_pool(spec, tmp_blocks):
            sizes = (max(spec.graph_config.prefill_sizes),)
            return make_prefill_graphs(spec, tmp_blocks, sizes, False, backend).capture().total_bytes
    finally:
        _release_cached_memory()


def _estimate_or_zero(estimate: Callable[[], int], gc_cfg: GraphConfig) -> int:
    try:
        return estimate()
    except CudaGraphCaptureError:
        if gc_cfg.fallback == "error":
            raise
        # Opted into eager fallback: the real capture below fails the same way, warns once and turns those
        # graphs off, so no memory is set aside for them.
        return 0


def _profile_activation_peak(spec: KVSpec) -> int:
    """Peak bytes a worst-case prefill (max_num_batched_tokens tokens in max_model_len-long sequences) adds on
    top of the weights, excluding the temporary KV pool it writes into. With chunked prefill a step's tokens may
    be the last chunk of a max_model_len context, so each profiled chunk attends over that whole context."""
    sc = spec.scheduler_config
    tokens = sc.max_num_batched_tokens
    seq_len = min(sc.max_model_len, tokens)
    num_seqs = max(1, min(sc.max_num_seqs, tokens // seq_len))
    context = max(seq_len, sc.max_model_len - 1)
    per_seq = math.ceil(context / spec.block_size)
    tmp_blocks = num_seqs * per_seq
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    seqs = tuple(ScheduledSeq(i, tuple([1] * seq_len), context - seq_len, tuple(range(i * per_seq, (i + 1) * per_seq)),
                              params, 0) for i in range(num_seqs))
    with temporary_kv_pool(spec, tmp_blocks):
        cache_bytes = torch.cuda.memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        with torch.inference_mode():
            inp = build_prefill_inputs(SchedulerOutput("prefill", seqs), spec.block_size, tmp_blocks, spec.device)
            hidden = spec.model(inp.input_ids, inp.positions, inp.meta)
            spec.model.compute_logits(hidden[inp.last_token_indices])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - cache_bytes
        del inp, hidden
    _release_cached_memory()  # the pool let go of, before start-up reads what is in use (charged as weights)
    return max(0, peak)


def estimate_graph_bytes(spec: KVSpec, largest: int, backend: CudaGraphBackend) -> int:
    """Capture the largest decode size once into a throwaway pool over a small temporary KV pool.

    The probe shares the real runner's backend (its capture stream), so what a capture stream costs once
    (its cuBLAS workspace) is counted in the estimate and not allocated a second time later."""
    tmp_blocks = max_blocks_per_seq(spec)
    try:
        with temporary_kv_pool(spec, tmp_blocks):
            return _capture_decode_probe(spec, tmp_blocks, largest, backend)
    finally:
        _release_cached_memory()


def _capture_decode_probe(spec: KVSpec, tmp_blocks: int, largest: int, backend: CudaGraphBackend) -> int:
    """Both graph sets' largest size captured over the temporary pool: their bytes. The runners, and the graph
    memory they hold, go when it returns."""
    _, probe, probe_processors = make_graph_runner(spec, tmp_blocks, (largest,), False, "error", progress=False,
                                                   backend=backend)
    report = probe.capture()
    probe_processors.share_output_of(probe)
    return report.total_bytes + probe_processors.capture().total_bytes


def _release_cached_memory() -> None:
    """What a probe freed, back to the device (the collector first: its graphs and runners hold tensors)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _compiles_ahead(spec: KVSpec) -> bool:
    """On one CUDA rank with graphs (a tensor-parallel step's collectives must keep one order on every rank)."""
    return (spec.device.type == "cuda" and spec.capture_error_mode == "global"
            and not spec.graph_config.enforce_eager and bool(spec.graph_config.capture_sizes))


def start_graph_kernel_compiles_early(spec: KVSpec, backend: CudaGraphBackend | None) -> RunningPass | None:
    """Start compiling the decode graphs' kernels before the memory profiling, so that on a cold Triton cache their
    compiles run while the profiling does (runner/compile_ahead.py). Returns with the warm-ups still compiling,
    holding no device memory (kernels/deferred_launch.py, PointerArg); the pass is finished (waited for) before
    anything is captured: a kernel loaded onto the device mid-capture would break the capture."""
    if not _compiles_ahead(spec):
        return None
    running = None
    try:
        running = _run_steps_over_a_throwaway_pool(spec, backend)
    except Exception as exc:  # as a failing step: the capture compiles in line, and says how many
        logger.warning("compiling ahead could not start, left to the capture: %s", exc, exc_info=exc)
    _release_cached_memory()  # the throwaway pool and steps, before the profiling reads what is in use
    return running


def _run_steps_over_a_throwaway_pool(spec: KVSpec, backend: CudaGraphBackend | None) -> RunningPass | None:
    """Each size's step, with and without the logits processors, once over a KV pool of one sequence's blocks: the
    kernels' specialisations depend on the pool's strides, not its length."""
    tmp_blocks = max_blocks_per_seq(spec)
    with temporary_kv_pool(spec, tmp_blocks):
        _, plain, with_processors = make_graph_runner(spec, tmp_blocks, spec.graph_config.capture_sizes, False, "error",
                                                      progress=False, backend=backend)
        return start_graph_kernel_compiles(plain.step_calls() + with_processors.step_calls(), spec.device)


def capture_decode_graphs(spec: KVSpec, graphs: CudaGraphRunner, lines: list[str]) -> CaptureReport:
    """graphs.capture(); what the capture compiled itself, after the pass ahead of it, goes to `lines`."""
    watch = spec.compile_watch if _compiles_ahead(spec) else None
    mark = watch.compiles if watch is not None else 0
    capture = graphs.capture()
    if watch is not None:
        lines.append(f"the capture compiled {len(watch.kernels_since(mark))} more kernels")
    return capture


def _plan_on_gpu(spec: KVSpec, backend: CudaGraphBackend | None, block_bytes: int, compiling: RunningPass | None,
                 lines: list[str]) -> tuple[KVCachePlan, int, int]:
    """Profile the activation peak, finish the compile-ahead pass, estimate the graphs' memory and give the KV pool
    the rest of the budget: (the plan, the decode and the prefill graph estimates)."""
    gc_cfg, sizes = spec.graph_config, spec.graph_config.capture_sizes
    estimate = prefill_estimate = 0
    logger.info("profiling a worst-case step to size the KV cache")
    t0 = time.perf_counter()
    activation = _profile_activation_peak(spec)
    if compiling is not None:  # before the reading below: the kernels it loaded stay on the device
        compiling.finish()
    free, total = torch.cuda.mem_get_info()
    # Everything in use now except the allocator's cached free memory: weights, CUDA context, other
    # processes. Charged as "weights" so the budget counts the whole device, as vLLM does. Read before
    # the graph probe: what the probe leaves behind (the capture stream's workspace) is in its estimate.
    in_use = total - free - (torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
    if not gc_cfg.enforce_eager:
        estimate = _estimate_or_zero(lambda: estimate_graph_bytes(spec, max(sizes), backend), gc_cfg)
        if gc_cfg.prefill_sizes:
            prefill_estimate = _estimate_or_zero(lambda: _estimate_prefill_graph_bytes(spec, backend), gc_cfg)
    # The decode rows' logits-processor tables are allocated with the decode step, after the KV pool.
    tables = state_bytes(decode_layout(spec, 0, sizes).rows, spec.model_config.vocab_size)
    plan = plan_kv_cache(total, spec.gpu_memory_utilization, in_use, activation + tables,
                         estimate + prefill_estimate, block_bytes, spec.block_size, spec.scheduler_config.max_model_len)
    lines.append(plan.summary())
    lines.append(f"memory profiling took {time.perf_counter() - t0:.1f} s (weights "
                 f"{spec.weights_bytes / 2**30:.2f} GiB, activation peak {activation / 2**30:.2f} GiB, "
                 f"graph estimate {estimate / 2**20:.0f} MiB decode + {prefill_estimate / 2**20:.0f} MiB "
                 "prefill)")
    return plan, estimate, prefill_estimate


def allocate_kv_and_graphs(spec: KVSpec) -> KVSetup:
    gc_cfg, mc = spec.graph_config, spec.model_config
    block_bytes = kv_block_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, spec.block_size,
                                 spec.kv_dtype.itemsize) + spec.extra_block_bytes
    max_len = spec.scheduler_config.max_model_len
    lines, plan = [], None
    sizes = gc_cfg.capture_sizes
    mode = {} if spec.capture_error_mode == "global" else {"capture_error_mode": spec.capture_error_mode}
    backend = CudaGraphBackend(spec.device, compile_watch=spec.compile_watch, **mode) \
        if sizes or gc_cfg.prefill_sizes else None
    estimate = prefill_estimate = 0
    compiling = start_graph_kernel_compiles_early(spec, backend)  # its compiles run on while the profiling does
    if spec.num_kv_blocks is not None:
        num_blocks = spec.num_kv_blocks
    elif spec.device.type != "cuda":
        want = spec.scheduler_config.max_num_seqs * max_blocks_per_seq(spec)
        num_blocks = max(max_blocks_per_seq(spec), min(want, CPU_KV_BUDGET_BYTES // block_bytes))
    else:
        plan, estimate, prefill_estimate = _plan_on_gpu(spec, backend, block_bytes, compiling, lines)
        num_blocks = plan.num_blocks
    if spec.agree_num_blocks is not None:
        fits = num_blocks
        num_blocks = spec.agree_num_blocks(fits)
        lines.append(f"KV blocks: this rank fits {fits}, every rank uses {num_blocks} (the smallest over the "
                     "tensor-parallel ranks)")
    if compiling is not None:  # (again: finishing twice waits once)
        compiling.finish()
    caches = allocate_kv_cache(spec, num_blocks)
    step, graphs, processor_graphs = make_graph_runner(spec, num_blocks, sizes, gc_cfg.enforce_eager,
                                                       gc_cfg.fallback, progress=spec.device.type == "cuda",
                                                       backend=backend)
    capture, processor_capture = capture_both(spec, graphs, processor_graphs, lines)
    check_decode_graphs(spec, step, (graphs, processor_graphs))
    prefill = make_prefill_graphs(spec, num_blocks, gc_cfg.prefill_sizes, spec.device.type == "cuda", backend,
                                  step.sampled)
    prefill_capture = prefill.capture()
    if prefill.enabled and not gc_cfg.skip_graph_check:
        with torch.inference_mode():
            check_prefill_graphs(prefill, spec.model, num_blocks, spec.model_config.vocab_size)
    if sizes and graphs.graphs_enabled:
        lines.append(graph_memory_report(_summed(capture.bytes_by_size, processor_capture.bytes_by_size),
                                         estimate, block_bytes, spec.block_size, max_len))
        lines.append(f"captured {len(capture.sizes)} decode graphs in {capture.seconds:.2f} s, and "
                     f"{len(processor_capture.sizes)} with the logits processors in {processor_capture.seconds:.2f} s")
    elif spec.device.type != "cuda":  # graphs are CUDA's: nothing the user set turned them off
        lines.append("no CUDA device: decode runs eager")
    elif graphs.disabled_cause:
        lines.append(f"CUDA graphs disabled: {graphs.disabled_cause}")
    if prefill.enabled:
        lines.append(graph_memory_report(prefill_capture.bytes_by_size, prefill_estimate, block_bytes,
                                         spec.block_size, max_len, what="prefill graphs", unit="tokens"))
        lines.append(f"captured {len(prefill_capture.sizes)} prefill graphs ({prefill_capture.sizes[0]}.."
                     f"{prefill_capture.sizes[-1]} tokens, up to {prefill.max_seqs} sequences) in "
                     f"{prefill_capture.seconds:.2f} s")
    elif gc_cfg.prefill_sizes:
        lines.append(f"prefill graphs disabled: {prefill.graphs.disabled_cause}")
    lines.append(_pool_line(spec, num_blocks, block_bytes))
    report = "\n".join(lines)
    for line in report.splitlines():
        logger.info(line)
    return KVSetup(CacheConfig(spec.block_size, num_blocks), caches, graphs, step, capture, processor_graphs,
                   processor_capture, report, plan, prefill, prefill_capture, backend)


def _pool_line(spec: KVSpec, num_blocks: int, block_bytes: int) -> str:
    """The start-up log's line on the KV pool (with the draft model's pool beside it, when there is one)."""
    draft = ", the draft model's pool included" if spec.extra_block_bytes else ""
    gib = num_blocks * block_bytes / 2**30
    dtype = str(spec.kv_dtype).removeprefix("torch.")
    return f"KV cache: {num_blocks} blocks x {spec.block_size} tokens, {dtype} ({gib:.3f} GiB{draft})"


def _summed(a: dict[int, int], b: dict[int, int]) -> dict[int, int]:
    """Per size, the bytes both graph sets' graphs of that size added."""
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted({*a, *b}, reverse=True)}
