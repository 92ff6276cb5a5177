"""Arrival counters for Triton kernels that merge their programs' partial results in the same launch (the
decode attention's single-launch split-KV): torch only, so that the modules that hold one need no Triton."""

from __future__ import annotations

import torch


class SplitCounters:
    """Arrival counters: one int32 per group of programs whose partials one launch merges (the decode
    attention: per (sequence, kv head)), zero between launches (the merging program resets its own). Allocated once per
    device, zeroed, and never freed or moved while a graph may read it: a CUDA graph bakes in the address, and a
    zero-fill inside the graph would be one more kernel per layer. Every layer shares one, since launches on one stream
    run one after another; launches sharing one must not run concurrently on two streams.

    Sized generously (MIN_COUNTERS covers every batch the split rule splits: programs < SMs); a launch
    that needs more grows it outside a capture only (the warm-up before each capture does), keeping the
    old tensor alive for graphs captured before."""

    MIN_COUNTERS = 4096

    def __init__(self) -> None:
        self._by_device: dict[torch.device, torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []

    def get(self, device: torch.device, needed: int) -> torch.Tensor:
        counters = self._by_device.get(device)
        if counters is None or counters.numel() < needed:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"a split launch needs {needed} arrival counters while a CUDA graph is being "
                                   "captured; run the same shape eagerly before capturing (the warm-up does)")
            if counters is not None:
                self._retired.append(counters)
            counters = torch.zeros(max(needed, self.MIN_COUNTERS), dtype=torch.int32, device=device)
            self._by_device[device] = counters
        return counters
