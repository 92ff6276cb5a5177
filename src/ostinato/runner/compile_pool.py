"""Compiles Triton kernel specialisations in worker processes, into Triton's on-disk cache.

Why processes: Triton's compile holds the GIL for most of its time (its Python code generator, MLIR passes
driven from Python), so threads of one process barely overlap; separate interpreters do. What a worker
compiles lands in the on-disk cache (TRITON_CACHE_DIR, inherited), under the very key the engine's own launch
computes later (same kernel source, specialisation, options and target), so that launch loads it instead of
compiling it: a cache hit of a few milliseconds.

The workers are plain subprocesses (`python -m ostinato.runner.compile_pool`), not multiprocessing: a spawned
multiprocessing child re-imports the user's __main__ script, which would start a second engine in every worker
of a script that does not guard its entry point. They see no GPU (CUDA_VISIBLE_DEVICES is empty): compiling for
a given target needs none, and a CUDA context per worker would take device memory the KV plan counts on. Each
imports Triton and torch as it starts, so a pool started early (before the weights load) is ready when the
kernels are known. A worker exits when its stdin closes, so none outlives the engine process.

Protocol: length-prefixed pickles, one KernelJob in, one JobResult out, in turn.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, BinaryIO

logger = logging.getLogger(__name__)

WORKERS_ENV = "OSTINATO_COMPILE_WORKERS"
MAX_WORKERS = 16  # past this, more processes cost start-up memory and time for little (a pass holds ~100 kernels)


@dataclass(frozen=True)
class JitRef:
    """A @triton.jit function passed as a constexpr, by where it is defined (functions do not pickle)."""
    module: str
    qualname: str


@dataclass(frozen=True)
class KernelJob:
    """One specialisation to compile, as the launch would: Triton's ASTSource(fn, signature, constexprs, attrs)
    compiled for `target` with `options` (the launch's options, all fields). expected_hash: the cache key the
    launch computes (runner/compile_ahead.py); the worker reports the one it compiled under."""
    module: str
    qualname: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    target: tuple  # GPUTarget's (backend, arch, warp_size)
    expected_hash: str
    name: str  # for the log

    @property
    def label(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass(frozen=True)
class JobResult:
    job: KernelJob
    hash: str | None  # the key compiled under; None on failure
    seconds: float
    error: str | None = None

    @property
    def matched(self) -> bool:
        return self.error is None and self.hash == self.job.expected_hash


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def compile_job(job: KernelJob) -> str:
    """Compile one job into the on-disk cache (this process's TRITON_CACHE_DIR); returns its cache key."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _resolve(job.module, job.qualname)
    constexprs = {k: _resolve(v.module, v.qualname) if isinstance(v, JitRef) else v for k, v in job.constexprs.items()}
    kernel = triton.compile(ASTSource(fn, job.signature, constexprs, job.attrs), target=GPUTarget(*job.target),
                            options=dict(job.options))
    return kernel.hash


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream: BinaryIO) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side closed the pipe")
    (size,) = struct.unpack("<Q", head)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the other side closed the pipe mid-message")
    return pickle.loads(data)


def default_workers() -> int:
    """One process per core but one (the engine's own thread keeps working), at most MAX_WORKERS;
    OSTINATO_COMPILE_WORKERS overrides (0: compile nothing ahead)."""
    given = os.environ.get(WORKERS_ENV, "").strip()
    if given:
        try:
            return max(0, int(given))
        except ValueError:
            logger.warning("%s=%r is not a number of processes: using the default", WORKERS_ENV, given)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_WORKERS, cores - 1))


def start_compile_pool(device_type: str, ranks: int, graphs: bool) -> "CompilePool | None":
    """A pool for the start-up's kernels, started now so that its processes import while the weights load;
    None where compiling ahead does not apply: off CUDA, without graphs, without Triton's compile hook, under
    tensor parallelism (a step holds collectives every rank must issue in the same order: no rank may skip
    them in a recording pass), or with OSTINATO_COMPILE_WORKERS=0."""
    if device_type != "cuda" or ranks > 1 or not graphs:
        return None
    try:
        import triton
    except ImportError:
        return None
    if not hasattr(getattr(getattr(triton, "knobs", None), "runtime", None), "jit_cache_hook"):
        return None
    workers = default_workers()
    if workers == 0:
        return None
    try:
        return CompilePool.start(workers)
    except OSError as e:
        logger.warning("could not start the kernel compile processes (%s): the captures compile their kernels", e)
        return None


class CompilePool:
    """Worker processes that compile KernelJobs; start() returns at once, the workers import while the caller
    goes on. compile() hands the jobs out one at a time to whichever worker is free."""

    def __init__(self, procs: list[subprocess.Popen]):
        self._procs = procs
        self._finalizer = weakref.finalize(self, _stop, list(procs))

    @classmethod
    def start(cls, workers: int | None = None) -> "CompilePool":
        n = workers or default_workers()
        src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # where ostinato is
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "",
               "PYTHONPATH": os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])}
        env.pop("TRITON_INTERPRET", None)  # the interpreter compiles nothing (the CPU tests set it)
        procs = [subprocess.Popen([sys.executable, "-m", "ostinato.runner.compile_pool"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
                 for _ in range(n)]
        return cls(procs)

    @property
    def workers(self) -> int:
        return len(self._procs)

    def compile(self, jobs: list[KernelJob], timeout_s: float = 300.0) -> list[JobResult]:
        """Compile every job; a job whose worker failed or died, or that was not done within timeout_s, comes
        back with its error (the launch then compiles it itself, as without this pool)."""
        todo: queue.SimpleQueue = queue.SimpleQueue()
        for job in jobs:
            todo.put(job)
        results: list[JobResult] = []
        lock = threading.Lock()
        deadline = time.monotonic() + timeout_s

        def serve(proc: subprocess.Popen) -> None:
            while time.monotonic() < deadline:
                try:
                    job = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    _send(proc.stdin, job)
                    result = JobResult(job, *_receive(proc.stdout))
                except (OSError, EOFError, pickle.PickleError) as e:
                    result = JobResult(job, None, 0.0, f"the compile worker died ({type(e).__name__}: {e}; "
                                                       f"exit code {proc.poll()})")
                    with lock:
                        results.append(result)
                    return  # this worker is gone; the others take the rest
                with lock:
                    results.append(result)

        threads = [threading.Thread(target=serve, args=(p,), daemon=True, name="compile-pool") for p in self._procs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [p for p, t in zip(self._procs, threads) if t.is_alive()]
        for proc in stuck:  # out of time mid-compile: its late answer must not be taken for a later job's
            proc.kill()
        self._procs = [p for p in self._procs if p not in stuck]
        with lock:
            done = {id(r.job) for r in results}
            missing = [j for j in jobs if id(j) not in done]
            out = list(results)
        out += [JobResult(j, None, 0.0, "not compiled ahead: no worker left, or out of time") for j in missing]
        return out

    def close(self) -> None:
        self._finalizer()


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            p.stdin.close()  # the worker's loop ends at EOF
        except OSError:
            pass
    for p in procs:
        try:
            p.wait(timeout=2)
        except subprocess.TimeoutExpired:
            p.kill()


def _serve(inp: BinaryIO, out: BinaryIO, broken: str | None = None) -> None:
    """Answer each job with (cache key, seconds, error); `broken`: why this worker cannot compile at all."""
    while True:
        try:
            job = _receive(inp)
        except EOFError:
            return
        t0 = time.perf_counter()
        try:
            if broken is not None:
                raise RuntimeError(broken)
            result = (compile_job(job), time.perf_counter() - t0, None)
        except Exception as e:  # noqa: BLE001  (any compile failure is the caller's to report, never ours to die of)
            result = (None, time.perf_counter() - t0, f"{type(e).__name__}: {e}"[:500])
        _send(out, result)


def main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a compile prints goes to stderr, never into the protocol
    import warnings

    warnings.simplefilter("ignore")
    broken = None
    try:
        import torch  # noqa: F401  (the kernels' modules import it: paid now, while the engine loads its weights)
        import triton.compiler  # noqa: F401
    except Exception as e:  # noqa: BLE001  (said in every answer, so the engine's log shows why)
        broken = f"the compile worker cannot import Triton: {type(e).__name__}: {e}"
    _serve(sys.stdin.buffer, out, broken)


if __name__ == "__main__":
    main()
