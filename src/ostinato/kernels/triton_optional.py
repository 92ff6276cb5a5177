"""triton, where it is installed (pip install ostinato[triton]); the torch paths need none.

The modules that hold Triton kernels take `triton`, `tl` and `jit` from here: without triton, `triton` and `tl`
are None and `jit` leaves a kernel a plain, never-called function, so those modules still import."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None
    tl = None


def jit(fn):
    """triton.jit when triton is installed; otherwise the kernel stays a plain, never-called function."""
    return triton.jit(fn) if triton is not None else fn
