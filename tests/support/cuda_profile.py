"""The GPU kernels a call launches, for tests that count kernels (torch.profiler; CUDA only)."""

from __future__ import annotations

import torch


def count_cuda_kernels(fn) -> list[str]:
    """Names of the GPU kernels (and memcpy/memset) `fn` launches, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
