"""Kernel launches that a compile-ahead pass turns into compiles: the kernel handed over with its exact arguments,
not run, and the outputs it would have written zeroed.

Why: runner/compile_ahead.py runs every decode graph size's step once before the capture, so that Triton
compiles the step's kernel specialisations then. A step reaches its kernels one after another, and each launch
waits for its own compile before the step goes on: on a cold start the batch-1 step compiled its five GEMV
specialisations in sequence. Inside such a pass (a thread in `compiling_instead`), a launch through `launch`
gives the kernel and its launch arguments to the pass's sink, which compiles them elsewhere (Triton's
`warmup`: the same arguments give the same specialisation key, so the capture finds the kernel built), and the
step goes on at once. The outputs are zeroed so that what reads them sees defined values: zeros index nothing
out of range, where the unwritten outputs of skipped launches once made the FP8 path's indexing assert on the
device.

Only launches whose callers name every tensor the kernel writes that a later op reads go through here: the
GEMV, the few-rows linear, the decode attention, the RMSNorm, the SwiGLU activation, the q/k norm and rotary
embedding, the two sampling kernels and the penalties. What a kernel writes into a cache (the new token's K/V) or
updates in place stays as it was, which only the pass's own later reads see.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

# (kernel, grid, positional arguments, keyword arguments): what `kernel[grid](*args, **kwargs)` would launch.
CompileSink = Callable[[Any, tuple, tuple, dict], None]

_local = threading.local()


@dataclass(frozen=True)
class PointerArg:
    """What a compile reads of a tensor argument: Triton specialises a kernel on the tensor's dtype and on whether
    its address is 16-byte aligned (`data_ptr`). Handed to the sink instead of the tensor, so that a launch waiting
    for its compile holds no device memory: start-up profiles memory while the compiles run."""

    dtype: torch.dtype
    address: int

    def data_ptr(self) -> int:
        return self.address


def _for_compile(value: Any) -> Any:
    return PointerArg(value.dtype, value.data_ptr()) if isinstance(value, torch.Tensor) else value


def launch(kernel: Any, grid: tuple, args: tuple, kwargs: dict, outputs: Sequence[torch.Tensor]) -> None:
    """kernel[grid](*args, **kwargs), or, in a thread inside `compiling_instead`, the launch handed to its sink
    (tensors as PointerArg) and `outputs` (every tensor the kernel writes that is read after it) zeroed."""
    sink: CompileSink | None = getattr(_local, "sink", None)
    if sink is None:
        kernel[grid](*args, **kwargs)
        return
    sink(kernel, grid, tuple(map(_for_compile, args)), {name: _for_compile(v) for name, v in kwargs.items()})
    for out in outputs:
        out.zero_()


@contextmanager
def compiling_instead(sink: CompileSink) -> Iterator[None]:
    """In this thread, launches through `launch` go to sink instead of the device."""
    previous = getattr(_local, "sink", None)
    _local.sink = sink
    try:
        yield
    finally:
        _local.sink = previous
