"""Capture/replay backends for CudaGraphRunner (runner/graphs.py).

`CudaGraphBackend` records real CUDA graphs. `RecordingGraphBackend` stands in for it on any device (it records
a callable instead of a graph), so padding, guards, counters and the fallback policy are tested on CPU through the
very runner code that runs on the GPU.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ostinato.errors import ConfigError

if TYPE_CHECKING:
    from ostinato.runner.compile_watch import CompileWatch


@dataclass(frozen=True)
class MemoryReading:
    device_bytes: int  # device memory in use (total - free), every process and the driver included
    reserved_bytes: int  # bytes the caching allocator holds


class GraphBackend(Protocol):
    """Captures and replays. `CudaGraphRunner` holds all the policy; a backend only does these steps."""

    def new_pool(self) -> Any: ...

    def warmup(self, fn: Callable[[], torch.Tensor], iters: int) -> None: ...

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        """Record fn; return (replay, static output)."""
        ...

    def memory_in_use(self) -> MemoryReading: ...

    def synchronize(self) -> None: ...

    def recover(self) -> str | None:
        """After a failed capture: bring the device back to a usable state. Returns why it could not."""
        ...

    def release(self) -> None:
        """After the graphs were dropped: hand their memory back."""
        ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture on one dedicated side stream (warm-up included, so lazily created
    workspaces exist before capture), every size in one shared pool, replay on the current stream."""

    def __init__(self, device: torch.device | str, capture_error_mode: str = "global",
                 compile_watch: CompileWatch | None = None):
        device = torch.device(device)
        if device.type != "cuda":
            raise ConfigError(f"CUDA graphs need a CUDA device, got {device}; run eager (--enforce-eager)")
        self._device = device
        self._capture_error_mode = capture_error_mode
        self._compile_watch = compile_watch  # names what Triton compiled inside a capture that failed
        self._stream: torch.cuda.Stream | None = None

    @property
    def device(self) -> torch.device:
        if self._device.index is None:  # resolved lazily: torch.cuda must not be touched at construction
            self._device = torch.device("cuda", torch.cuda.current_device())
        return self._device

    def _capture_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warmup(self, fn: Callable[[], torch.Tensor], iters: int) -> None:
        stream, current = self._capture_stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for _ in range(iters):
                fn()
        current.wait_stream(stream)

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize(self.device)
        mark = self._compile_watch.compiles if self._compile_watch is not None else 0
        # Not torch.cuda.graph(): when capture_end fails there, its __exit__ skips restoring the stream.
        # No garbage collection inside the capture (CudaGraphRunner.capture collects before the first size):
        # finalizing an earlier engine's objects there can make CUDA calls a capture forbids (an event query, a
        # pinned-memory free), which would fail this capture for no fault of the step.
        with torch.cuda.device(self.device), torch.cuda.stream(self._capture_stream()), _gc_paused():
            graph.capture_begin(pool=pool, capture_error_mode=self._capture_error_mode)
            try:
                out = fn()
            except BaseException as e:
                self._close_failed_capture(graph, pool, still_capturing=True)
                self._explain(e, mark)
                raise
            try:
                graph.capture_end()
            except BaseException as e:
                self._close_failed_capture(graph, pool, still_capturing=False)
                self._explain(e, mark)
                raise
        torch.cuda.synchronize(self.device)
        return graph.replay, out

    def _explain(self, error: BaseException, mark: int) -> None:
        """Add what is known about an invalidated capture to the error (notes; describe_capture_failure shows
        them): a Triton compile inside the capture (its module load is not allowed there: a kernel variant
        the warm-up did not meet, e.g. another pointer alignment), or other live threads (in the global mode
        any thread's unsafe CUDA call, such as an event query, invalidates the capture)."""
        if self._compile_watch is not None:
            compiled = self._compile_watch.kernels_since(mark)
            if compiled:
                error.add_note(f"Triton compiled {', '.join(compiled)} inside the capture, after the warm-up "
                               "that should have compiled it; please report this line.")
        others = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        if others and self._capture_error_mode == "global":
            error.add_note(f"Threads alive during the capture (global mode fails it on any thread's unsafe "
                           f"CUDA call): {', '.join(others)}.")

    def _close_failed_capture(self, graph: torch.cuda.CUDAGraph, pool: Any, still_capturing: bool) -> None:
        """Take the stream out of capture mode and the allocator out of the graph pool.

        An invalidated capture makes capture_end fail at cudaStreamEndCapture, before torch tells the
        caching allocator the capture is over; we do that here (private torch calls, best effort)."""
        if still_capturing:
            try:
                graph.capture_end()
                return  # the capture was still valid: dropping `graph` releases its pool share
            except Exception:
                pass
        end_to_pool = getattr(torch._C, "_cuda_endAllocateToPool", None)
        release_pool = getattr(torch._C, "_cuda_releasePool", None)
        if end_to_pool is None or release_pool is None:
            return
        try:
            end_to_pool(self.device.index, pool)
        except Exception:
            return  # capture_end got that far itself: the graph object releases the pool
        try:
            release_pool(self.device.index, pool)
        except Exception:
            pass

    def memory_in_use(self) -> MemoryReading:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # drop cached warm-up blocks so only what stays allocated is counted
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReading(total - free, torch.cuda.memory_reserved(self.device))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def recover(self) -> str | None:
        try:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.zeros(1, device=self.device).add_(1).cpu()  # a launch and a copy must work again
            self._reset_generators()
        except Exception as e:  # a sticky error (e.g. illegal memory access) poisons the CUDA context
            return f"CUDA is unusable after the failed capture ({first_line(e)}); restart the process"
        return None

    def release(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _reset_generators(self) -> None:
        """A capture that failed after capture_begin leaves the default CUDA generator in capture mode
        (capture_end, which would end it, never ran), and every later random op on the device fails with
        "Offset increment outside graph capture". One small capture that completes resets it."""
        probe = torch.cuda.CUDAGraph()
        scratch = torch.zeros(1, device=self.device)
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            probe.capture_begin()
            scratch.add_(1)
            probe.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        del probe


class RecordingGraphBackend:
    """A stand-in for CUDA graphs on any device, for tests and CPU dry runs.

    'Capture' runs fn once and records it; 'replay' runs it again and copies the result into the recorded
    output, so the output is a static tensor exactly as with a CUDA graph. Unlike a real graph, Python in
    fn runs on every replay: this checks the runner's bookkeeping, not whether a step is graph-safe.
    Memory readings are zero; override memory_in_use to simulate growth.
    """

    def new_pool(self) -> Any:
        return None

    def warmup(self, fn: Callable[[], torch.Tensor], iters: int) -> None:
        for _ in range(iters):
            fn()

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> tuple[Callable[[], None], torch.Tensor]:
        out = fn()
        if not isinstance(out, torch.Tensor):
            return (lambda: None), out  # the runner reports the bad return type
        return (lambda: out.copy_(fn())), out

    def memory_in_use(self) -> MemoryReading:
        return MemoryReading(0, 0)

    def synchronize(self) -> None:
        pass

    def recover(self) -> str | None:
        return None

    def release(self) -> None:
        pass


def first_line(e: BaseException) -> str:
    text = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@contextlib.contextmanager
def _gc_paused():
    """Keep the garbage collector off until the block ends (restored as it was)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
