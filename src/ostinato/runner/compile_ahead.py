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

from ostinato.kernels.deferred_launch import compiling_instead

logger = logging.getLogger(__name__)

# Threads, so steps in flight at once: each holds its step's activations (a batch-256 step of an 8B model holds
# 128 MiB of float32 logits) beyond what the KV plan charged for one step.
DEFAULT_WORKERS = 4


@dataclass(frozen=True)
class CompileAheadReport:
    steps: int  # the step functions run (one per capture size)
    compiles: int  # Triton compilations they triggered
    seconds: float
    workers: int
    error: str | None = None  # the first step failure, if any (the capture meets it again and reports it)
    warmups: int = 0  # distinct deferred launches handed to Triton's warm-up
    warmed: tuple[tuple[str, int], ...] = ()  # (kernel, its warm-ups), most first
    compile_threads: int = 0  # the pool that built them
    warmup_error: str | None = None  # the first warm-up failure, if any (the capture compiles that kernel)

    def summary(self) -> str:
        kernels = ", ".join(f"{name} {count}" for name, count in self.warmed)
        warmups = (f"; {self.warmups} launches built as warm-ups on {self.compile_threads} threads: {kernels}"
                   if self.compile_threads else "")
        line = (f"compiled {self.compiles} kernels ahead for {self.steps} graph sizes in {self.seconds:.2f} s "
                f"({self.workers} step threads{warmups})")
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
    if isinstance(value, torch.Tensor):
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
                                        initializer=prepare_thread)
        self._lock = threading.Lock()
        self._seen: set[Hashable] = set()
        self._kernels: set[int] = set()
        self._futures: list[tuple[str, Future]] = []

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
            self._futures.append((_kernel_name(kernel), self._pool.submit(_build, kernel, grid, args, kwargs)))

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


def compile_ahead(steps: Sequence[Callable[[], Any]], prepare_thread: Callable[[], None] = lambda: None,
                  workers: int = DEFAULT_WORKERS, knobs: Any = None,
                  synchronize: Callable[[], None] = lambda: None,
                  deferred: DeferredCompiles | None = None) -> CompileAheadReport | None:
    """Run each of `steps` once in a pool of `workers` threads, device work one thread at a time, Triton's
    compiles side by side (module docstring). prepare_thread runs first in each thread (the CUDA device and
    grad mode are per thread); synchronize after all steps. knobs: Triton's runtime knobs (found when None).
    deferred: where the steps' deferred launches go (built as warm-ups on threads of their own); None runs them.
    Returns None where it does not apply (no Triton hooks, fewer than two steps): the capture compiles."""
    knobs = knobs if knobs is not None else _triton_runtime_knobs()
    hooks = ("jit_cache_hook", "jit_post_compile_hook")
    if knobs is None or not all(hasattr(knobs, hook) for hook in hooks) or len(steps) < 2:
        return None
    turns = DeviceTurns()
    compiles = _SharedCount()
    previous_before, previous_after = knobs.jit_cache_hook, knobs.jit_post_compile_hook

    def before(**kwargs):
        result = previous_before(**kwargs) if previous_before is not None else None  # e.g. the CompileWatch
        if not result:  # True would skip the compile: then there is nothing to wait for, keep the turn
            compiles.add()
            turns.before_compile()
        return result

    def after(**kwargs):
        turns.after_compile()
        return previous_after(**kwargs) if previous_after is not None else None

    def one(step):
        prepare_thread()
        if deferred is None:
            turns.run(step)
            return
        with compiling_instead(deferred):
            turns.run(step)

    t0 = time.perf_counter()
    error = None
    warmed: tuple[tuple[str, int], ...] = ()
    warmup_error = None
    workers = max(1, min(workers, len(steps)))
    knobs.jit_cache_hook, knobs.jit_post_compile_hook = before, after
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="compile") as pool:
            for i, future in enumerate([pool.submit(one, step) for step in steps]):
                exc = future.exception()
                if exc is not None:
                    # Every failure is said, the first with its traceback: a failure in the thread's set-up
                    # (before any launch) fails every step alike and leaves all the compiles to the capture.
                    logger.warning("compiling ahead: step %d of %d failed, its kernels are left to the capture: "
                                   "%s: %s", i + 1, len(steps), type(exc).__name__, exc,
                                   exc_info=exc if error is None else None)
                    error = error or f"{type(exc).__name__}: {exc}"[:300]
        if deferred is not None:
            warmed, warmup_error = deferred.finish()
        synchronize()
    finally:
        knobs.jit_cache_hook, knobs.jit_post_compile_hook = previous_before, previous_after
    report = CompileAheadReport(len(steps), compiles.value, time.perf_counter() - t0, workers, error,
                                sum(count for _, count in warmed), warmed,
                                deferred.threads if deferred is not None else 0, warmup_error)
    failed = error is not None or warmup_error is not None
    logger.log(logging.WARNING if failed else logging.INFO, report.summary())
    return report


class _SharedCount:
    """A count that several threads add to."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.value += 1
