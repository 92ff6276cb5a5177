"""Compiles the decode graphs' Triton kernels before their capture, several at a time.

Why: on a machine whose Triton cache is empty, the capture loop compiles each batch size's new kernel
specialisations (GEMV and few-rows tiles, split plans, sampling chunk plans, integer arguments equal to 1 or
divisible by 16) one after the other, and a first start's capture took several times as long as a later one's.
Which specialisations a size needs is known only by running its step (its constexprs come from host-side
plans over the shapes), so every size's step runs once, eagerly, each in a thread of a pool. The device stays
one thread's at a time: a thread runs its torch ops and launches holding a turn, gives the turn up when Triton
is about to compile (Triton's compile hook) and takes it back once the kernel is built (the post-compile hook),
before its launch. So launches stay in each step's program order and never overlap another step's, and only
compiles run side by side (Triton's compiler spends most of its time in MLIR, LLVM and ptxas).

Still, a step waits for each of its compiles before it reaches its next kernel, so one step's compiles ran in
sequence (the batch-1 step's five GEMV specialisations). The launches that say what they write
(kernels/deferred_launch.py: the linears, the decode attention, the norms, the sampling kernels) are therefore
not run in the pass: each distinct specialisation goes, with the launch's own arguments, to a pool of compile
threads (one per CPU: a compile holds no device memory) as a Triton warm-up, which builds the kernel the
capture's launch looks up (and its launcher, which Triton would otherwise build at the first launch), and the
step goes on at once over zeroed outputs.

Start-up (runner/kv_setup.py) runs the steps over a throwaway KV pool before it profiles memory, and waits for the
warm-ups only before the first capture: on a cold cache they compile while the profiling runs (RunningPass).

Not used (the capture compiles as before) off CUDA, without Triton or its two hooks, and under tensor
parallelism, whose steps hold collectives that every rank must issue in the same order. Any failure here is
logged and left to the capture, which reports it with its own fallback policy.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Hashable

import torch

from ostinato.kernels.deferred_launch import PointerArg, compiling_instead

logger = logging.getLogger(__name__)

# Threads, so steps in flight at once: each holds its step's activations (a batch-256 step of an 8B model holds
# 128 MiB of float32 logits) beyond what the KV plan charged for one step.
DEFAULT_WORKERS = 4


@dataclass(frozen=True)
class CompileAheadReport:
    steps: int  # the step functions run (one per capture size and graph set)
    compiles: int  # Triton compilations they triggered
    seconds: float  # from the first step to the last warm-up's end
    workers: int
    error: str | None = None  # the first step failure, if any (the capture meets it again and reports it)
    warmups: int = 0  # distinct deferred launches handed to Triton's warm-up
    warmed: tuple[tuple[str, int], ...] = ()  # (kernel, its warm-ups), most first
    compile_threads: int = 0  # the pool that built them
    warmup_error: str | None = None  # the first warm-up failure, if any (the capture compiles that kernel)
    waited: float = 0.0  # of `seconds`, what the caller waited in `finish` for the warm-ups still compiling

    def summary(self) -> str:
        kernels = ", ".join(f"{name} {count}" for name, count in self.warmed)
        warmups = (f"; {self.warmups} launches built as warm-ups on {self.compile_threads} threads: {kernels}"
                   if self.compile_threads else "")
        line = (f"compiled {self.compiles} kernels ahead for {self.steps} graph steps in {self.seconds:.2f} s "
                f"({self.workers} step threads{warmups}); waited {self.waited:.2f} s for them at the end")
        if self.error is not None:
            line += f"; a step failed, left to the capture: {self.error}"
        if self.warmup_error is not None:
            line += f"; a warm-up failed, left to the capture: {self.warmup_error}"
        return line


class DeviceTurns:
    """Hands the device to one worker thread at a time; a worker gives up its turn while Triton compiles.
    Threads that are not workers of this object pass through the hooks untouched."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local = threading.local()

    def _state(self) -> tuple[bool, bool]:
        return getattr(self._local, "worker", False), getattr(self._local, "holding", False)

    def run(self, step: Callable[[], Any]) -> None:
        """Run step as a worker: holding the turn except while Triton compiles for it."""
        self._local.worker = True
        self._take()
        try:
            step()
        finally:
            if self._state()[1]:
                self._give()
            self._local.worker = False

    def _take(self) -> None:
        self._lock.acquire()
        self._local.holding = True

    def _give(self) -> None:
        self._local.holding = False
        self._lock.release()

    def before_compile(self) -> None:
        worker, holding = self._state()
        if worker and holding:
            self._give()

    def after_compile(self) -> None:
        worker, holding = self._state()
        if worker and not holding:
            self._take()


# A start-up builds a few dozen distinct specialisations, and each compile in flight holds its own compiler state
# (host memory): more threads than this would not shorten the pass on a many-core host.
MAX_COMPILE_THREADS = 32


def default_compile_threads() -> int:
    """One compile thread per CPU this process may run on, at most MAX_COMPILE_THREADS."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_COMPILE_THREADS))


def specialisation_class(value: Any) -> Hashable:
    """What of a positional launch argument Triton specialises a kernel on: a tensor's dtype and whether its
    address is 16-byte aligned, an integer's being 1, divisible by 16 and its width; other values as they are.
    Two launches alike in these need one compile; should this be coarser than Triton's own key somewhere, a
    specialisation is left to the capture (its log counts what it compiled), never wrongly reused."""
    if isinstance(value, (torch.Tensor, PointerArg)):
        return "tensor", value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return "int", value == 1, value % 16 == 0, -2**31 <= value < 2**31
    if isinstance(value, float):
        return "float"
    return _hashable(value)


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


class DeferredCompiles:
    """Where the steps' deferred launches go (kernels/deferred_launch.py): each distinct specialisation built once,
    as Triton's warm-up of that launch (compiled, not run), in a pool of threads. device: the CUDA device index
    the pool's threads are on (prepare_thread sets it)."""

    def __init__(self, threads: int, prepare_thread: Callable[[], None], device: int) -> None:
        self.threads, self.device = threads, device
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="compile_warmup",
                                        initializer=mark_pass_thread(prepare_thread))
        self._lock = threading.Lock()
        self._seen: set[Hashable] = set()
        self._kernels: set[int] = set()
        self._futures: list[tuple[str, Future]] = []
        self.done_at: float | None = None  # perf_counter() when the last warm-up ended
        self._done_lock = threading.Lock()

    def _done(self, _: Future) -> None:
        with self._done_lock:  # not _lock: a future done before its callback is added calls it under _lock
            self.done_at = max(self.done_at or 0.0, time.perf_counter())

    def __call__(self, kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
        key = (id(kernel), tuple(map(specialisation_class, args)),
               tuple(sorted((name, _hashable(value)) for name, value in kwargs.items())))
        with self._lock:
            if key in self._seen:
                return
            self._seen.add(key)
            if id(kernel) not in self._kernels:
                self._kernels.add(id(kernel))
                self._build_binder(kernel)
            future = self._pool.submit(_build, kernel, grid, args, kwargs)
            future.add_done_callback(self._done)
            self._futures.append((_kernel_name(kernel), future))

    def _build_binder(self, kernel: Any) -> None:
        """Triton builds a kernel's per-device launch binder, which holds its compiled specialisations, on the
        first launch or warm-up, in a dict it fills unlocked: two warm-ups of a new kernel at once on the pool
        could each build one, and the one overwritten would take its compiled kernel with it (the capture would
        then build that one again). So it is built here first, once per kernel, in the step's thread."""
        caches = getattr(kernel, "device_caches", None)
        if caches is not None:
            caches[self.device]  # noqa: B018  (a defaultdict: the lookup builds it)

    def finish(self) -> tuple[tuple[tuple[str, int], ...], str | None]:
        """Wait for every warm-up; returns ((kernel, its warm-ups) most first, the first failure as text, if
        any)."""
        self._pool.shutdown(wait=True)
        error = None
        for _, future in self._futures:
            exc = future.exception()
            if exc is not None:
                logger.warning("compiling ahead: a kernel's warm-up failed, left to the capture: %s: %s",
                               type(exc).__name__, exc, exc_info=exc if error is None else None)
                error = error or f"{type(exc).__name__}: {exc}"[:300]
        return tuple(Counter(name for name, _ in self._futures).most_common()), error


def _build(kernel: Any, grid: tuple, args: tuple, kwargs: dict) -> None:
    """Triton's warm-up of the launch (the compile), then what Triton otherwise does at the kernel's first launch:
    its launcher, a C extension built with the host compiler on a cold cache, and the binary's load onto the
    device. Done here, these run side by side too, and not one after another in the capture loop."""
    compiled = kernel.warmup(*args, grid=grid, **kwargs)
    load = getattr(compiled, "_init_handles", None)
    if callable(load):
        load()


def _kernel_name(kernel: Any) -> str:
    return getattr(getattr(kernel, "fn", kernel), "__name__", type(kernel).__name__)


def _triton_runtime_knobs():
    try:
        import triton
    except ImportError:
        return None
    return getattr(getattr(triton, "knobs", None), "runtime", None)


def start_compile_ahead(steps: Sequence[Callable[[], Any]], prepare_thread: Callable[[], None] = lambda: None,
                        workers: int = DEFAULT_WORKERS, knobs: Any = None,
                        synchronize: Callable[[], None] = lambda: None,
                        deferred: DeferredCompiles | None = None) -> RunningPass | None:
    """Run each of `steps` once in a pool of `workers` threads, device work one thread at a time, Triton's
    compiles side by side (module docstring); return once they ran, their deferred launches perhaps still
    compiling (the caller calls `finish` later). prepare_thread runs first in each thread (the CUDA device and grad
    mode are per thread); synchronize after all steps. knobs: Triton's runtime knobs (found when None). deferred:
    where the deferred launches go (built as warm-ups on threads of their own); None runs them. None where it does
    not apply (no Triton hooks, fewer than two steps): the capture compiles."""
    knobs = knobs if knobs is not None else _triton_runtime_knobs()
    hooks = ("jit_cache_hook", "jit_post_compile_hook")
    if knobs is None or not all(hasattr(knobs, hook) for hook in hooks) or len(steps) < 2:
        return None
    running = RunningPass(knobs, deferred, max(1, min(workers, len(steps))), len(steps))
    running.run_steps(steps, prepare_thread, synchronize)
    return running


_pass_thread = threading.local()  # .on: a thread of a pass (a step's, or a warm-up's), whose compiles it counts


def mark_pass_thread(prepare_thread: Callable[[], None]) -> Callable[[], None]:
    """prepare_thread, also marking the thread as the pass's (DeferredCompiles' threads take it)."""
    def prepare() -> None:
        _pass_thread.on = True
        prepare_thread()
    return prepare


class RunningPass:
    """A compile-ahead pass: Triton's two hooks are its own (chained to those set before) from construction until
    `finish`, which waits for the warm-ups and puts the hooks back. Counts the compiles of its own threads only:
    another thread (the start-up's memory profiling) may compile meanwhile."""

    def __init__(self, knobs: Any, deferred: DeferredCompiles | None, workers: int, steps: int) -> None:
        self.knobs, self.deferred, self.workers, self.steps = knobs, deferred, workers, steps
        self.turns = DeviceTurns()
        self.compiles = _SharedCount()
        self.error: str | None = None
        self.t0 = time.perf_counter()
        self.steps_seconds = 0.0
        self._report: CompileAheadReport | None = None
        self._previous = knobs.jit_cache_hook, knobs.jit_post_compile_hook
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = self._before, self._after

    def _before(self, **kwargs):
        previous = self._previous[0]
        result = previous(**kwargs) if previous is not None else None  # e.g. the CompileWatch
        if not result:  # True would skip the compile: then there is nothing to wait for, keep the turn
            if getattr(_pass_thread, "on", False):
                self.compiles.add()
            self.turns.before_compile()
        return result

    def _after(self, **kwargs):
        self.turns.after_compile()
        previous = self._previous[1]
        return previous(**kwargs) if previous is not None else None

    def run_steps(self, steps: Sequence[Callable[[], Any]], prepare_thread: Callable[[], None],
                  synchronize: Callable[[], None]) -> None:
        def one(step):
            mark_pass_thread(prepare_thread)()
            if self.deferred is None:
                self.turns.run(step)
                return
            with compiling_instead(self.deferred):
                self.turns.run(step)

        try:
            with ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="compile") as pool:
                for i, future in enumerate([pool.submit(one, step) for step in steps]):
                    exc = future.exception()
                    if exc is not None:
                        # Every failure is said, the first with its traceback: a failure in the thread's set-up
                        # (before any launch) fails every step alike and leaves all the compiles to the capture.
                        logger.warning("compiling ahead: step %d of %d failed, its kernels are left to the "
                                       "capture: %s: %s", i + 1, len(steps), type(exc).__name__, exc,
                                       exc_info=exc if self.error is None else None)
                        self.error = self.error or f"{type(exc).__name__}: {exc}"[:300]
            synchronize()
        except BaseException:
            self._put_hooks_back()
            raise
        self.steps_seconds = time.perf_counter() - self.t0

    def finish(self) -> CompileAheadReport:
        """Wait for the warm-ups still compiling, put the hooks back, log and return the report (again: the same)."""
        if self._report is not None:
            return self._report
        waited_from = time.perf_counter()
        warmed: tuple[tuple[str, int], ...] = ()
        warmup_error = None
        try:
            if self.deferred is not None:
                warmed, warmup_error = self.deferred.finish()
        finally:
            self._put_hooks_back()
        done = self.deferred.done_at if self.deferred is not None else None
        seconds = max(self.steps_seconds, (done or self.t0) - self.t0)
        report = CompileAheadReport(self.steps, self.compiles.value, seconds, self.workers, self.error,
                                    sum(count for _, count in warmed), warmed,
                                    self.deferred.threads if self.deferred is not None else 0, warmup_error,
                                    time.perf_counter() - waited_from)
        failed = self.error is not None or warmup_error is not None
        logger.log(logging.WARNING if failed else logging.INFO, report.summary())
        self._report = report
        return report

    def _put_hooks_back(self) -> None:
        self.knobs.jit_cache_hook, self.knobs.jit_post_compile_hook = self._previous


def start_graph_kernel_compiles(steps: Sequence[Callable[[], Any]], device: torch.device) -> RunningPass | None:
    """start_compile_ahead over graph steps, each thread on the calling thread's CUDA device and in its autograd
    mode (both are per thread: a new thread starts on device 0 with grad on), the deferred launches built on one
    thread per CPU."""
    # Resolved here, in the calling thread: torch.device("cuda") has no index, which set_device refuses, and "the
    # current device" in a new thread is device 0, whatever this thread's is.
    index = device.index if device.index is not None else torch.cuda.current_device()
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def prepare_thread() -> None:
        torch.cuda.set_device(index)

    def as_the_capture_runs(step: Callable[[], Any]) -> Callable[[], None]:
        # Not inference mode unless the caller is in it: a buffer a step creates lazily would be an inference
        # tensor, which the capture could then not update in place.
        def run() -> None:
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                step()
        return run

    def settle() -> None:
        # The steps' activations, freed but cached by the allocator, would be out of reach of the graphs'
        # private pool and count as in use for the memory profiling: hand them back.
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()

    logger.info("compiling the decode graphs' kernels ahead (%d graph steps, cuda:%d)", len(steps), index)
    deferred = DeferredCompiles(default_compile_threads(), prepare_thread, index)
    return start_compile_ahead([as_the_capture_runs(step) for step in steps], prepare_thread, synchronize=settle,
                               deferred=deferred)


class _SharedCount:
    """A count that several threads add to."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1
