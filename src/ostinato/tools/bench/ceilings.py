"""The machine's own ceilings, measured where a bench runs: the memory read bandwidth and the dense matmul rate
its floors divide by.

Why measured: an H200 (HBM3e) reads its memory about 1.4x as fast as an H100 (HBM3), so a floor computed from one
card's bandwidth makes a run on the other look worse or better than it is.
Each figure takes well under a second and is measured once per process and device.

    read_bytes_per_s   the best of several full reads of a buffer many times the last-level cache (a sum:
                       one read of every byte, a few KB written), bytes a second
    matmul_flops_per_s the best of several square matmuls, 2 n^3 FLOPs each, in the dtype models run in there
                       (bf16 on a GPU, fp32 on a CPU)
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

# Far larger than any GPU's L2 (50 MB on an H100, 60 MB on an H200) and than a CPU's last-level cache; the CPU's
# buffer is smaller only to keep a CPU bench's start short.
_READ_BUFFER_BYTES = {"cuda": 1 << 30, "cpu": 1 << 28}
_MATMUL_SIZE = {"cuda": 8192, "cpu": 1024}
_REPEATS = 8
_WARM_SECONDS = {"cuda": 0.3, "cpu": 0.05}


@dataclass(frozen=True)
class Ceilings:
    """What one device sustains, as measured on it."""

    device: str
    read_bytes_per_s: float
    matmul_flops_per_s: float
    matmul_dtype: str

    def describe(self) -> str:
        return (f"{self.device}: memory read {self.read_bytes_per_s / 1e9:,.0f} GB/s, {self.matmul_dtype} matmul "
                f"{self.matmul_flops_per_s / 1e9:,.0f} GFLOP/s (measured here)")


def engine_ceilings(engine_args) -> Ceilings:
    """The ceilings of the device an engine built from engine_args runs on (--device, "auto" resolved as the
    runner resolves it). Call it before the engine is built: the model then has the memory to itself."""
    from ostinato.runner.backends import pick_device

    return measure_ceilings(str(pick_device(engine_args.device)))


@functools.cache
def measure_ceilings(device: str) -> Ceilings:
    """Ceilings of `device` ("cuda", "cuda:1", "cpu"). Call it before a model takes the GPU's memory: it
    allocates up to 1 GiB there for a moment."""
    import torch

    dev = torch.device(device)
    kind = "cuda" if dev.type == "cuda" else "cpu"
    dtype = torch.bfloat16 if kind == "cuda" else torch.float32
    name = torch.cuda.get_device_name(dev) if kind == "cuda" else "cpu"
    buffer = torch.ones(_READ_BUFFER_BYTES[kind] // 4, dtype=torch.float32, device=dev)
    read = buffer.numel() * 4 / _best_seconds(lambda: buffer.sum(), dev)
    del buffer
    n = _MATMUL_SIZE[kind]
    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    flops = 2 * n ** 3 / _best_seconds(lambda: a @ b, dev)
    return Ceilings(name, read, flops, str(dtype).removeprefix("torch."))


def _best_seconds(fn, device) -> float:
    """The fastest of _REPEATS calls, each timed alone, after _WARM_SECONDS of calls: an idle GPU's clocks take
    tens of milliseconds to rise, and a figure taken before reads low."""
    import torch

    on_gpu = device.type == "cuda"
    start = time.perf_counter()
    while time.perf_counter() - start < _WARM_SECONDS[device.type]:
        fn()
        if on_gpu:
            torch.cuda.synchronize(device)
    return min(elapsed_ms(fn, on_gpu) for _ in range(_REPEATS)) / 1e3


def elapsed_ms(fn, on_gpu: bool) -> float:
    """Milliseconds one call of fn takes: between two CUDA events recorded around it on a GPU (what it queued,
    run to the end), by the host's clock otherwise."""
    import torch

    if not on_gpu:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end)
