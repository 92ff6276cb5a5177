"""Runs an `ostinato` command with every Triton compile timed: where a cold start's compile time goes.

    TRITON_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python3 benchmarks/step/compile_times.py bench CK \\
        --max-model-len 1024 --gpu-memory-utilization 0.5 --batch-sizes 1 --context 512 --no-hf --iters 20

An empty TRITON_CACHE_DIR makes it a first start on the machine. At exit it prints, after the command's own output,
lines starting with "##": the number of compiles and their summed seconds, each kernel's compiles (count, sum,
slowest), the 15 slowest compiles with their thread, the host C modules Triton built or loaded (its launchers, at a
kernel's first launch or runner/compile_ahead.py's warm-up; a cold cache runs the host compiler for each), and the
timeline (start in seconds since launch, duration, thread, kernel; "[C] name" for a C module). Compiles on threads
named compile_N (the steps) and compile_warmup_N (the warm-ups) are runner/compile_ahead.py's; MainThread's happen
in line.
"""

import atexit
import sys
import threading
import time

import triton.compiler

T0 = time.perf_counter()
_compile = triton.compiler.compile  # looked up by each JIT function when it first builds its binder
rows: list[tuple[float, float, str, str]] = []  # (start, seconds, kernel, thread)


def timed_compile(src, *args, **kwargs):
    start = time.perf_counter()
    try:
        return _compile(src, *args, **kwargs)
    finally:
        name = getattr(getattr(src, "fn", None), "__name__", str(src))
        rows.append((start - T0, time.perf_counter() - start, name, threading.current_thread().name))


@atexit.register
def report() -> None:
    print(f"## COMPILES {len(rows)}, {sum(r[1] for r in rows):.2f} s summed")
    by_kernel: dict[str, list[float]] = {}
    for _, seconds, name, _ in rows:
        by_kernel.setdefault(name, []).append(seconds)
    for name, times in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"## KERNEL {name:40s} n={len(times):3d} sum={sum(times):6.2f} s slowest={max(times):5.2f} s")
    for start, seconds, name, thread in sorted(rows, key=lambda r: -r[1])[:15]:
        print(f"## SLOW at {start:7.2f} s {seconds:5.2f} s {name} ({thread})")
    print(f"## C MODULES {len(c_modules)}, {sum(r[1] for r in c_modules):.2f} s summed, slowest "
          f"{max((r[1] for r in c_modules), default=0.0):.2f} s")
    for start, seconds, name, thread in sorted(rows + c_modules):
        print(f"## T {start:7.2f} {seconds:5.2f} {thread:16s} {name}")


triton.compiler.compile = timed_compile
c_modules: list[tuple[float, float, str, str]] = []  # the same, for the C modules


def _time_c_modules() -> None:
    try:
        import triton.backends.nvidia.driver as nvidia_driver
    except ImportError:  # no CUDA backend: nothing to time
        return
    # What the driver's launchers call, by this module-level name (triton 3.6; later versions name it otherwise
    # and go untimed).
    build = getattr(nvidia_driver, "compile_module_from_src", None)
    if build is None:
        return

    def timed_build(*args, **kwargs):
        start = time.perf_counter()
        try:
            return build(*args, **kwargs)
        finally:
            name = kwargs.get("name", args[1] if len(args) > 1 else "?")
            c_modules.append((start - T0, time.perf_counter() - start, f"[C] {name}",
                              threading.current_thread().name))

    nvidia_driver.compile_module_from_src = timed_build


_time_c_modules()
from ostinato.cli import main  # noqa: E402  (after the patch: JIT functions bind compile lazily, at first launch)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
