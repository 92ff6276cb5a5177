"""Shared by the GPU measuring scripts: the HBM read ceiling, measured on this GPU when a script starts, and a
CUDA-graph timer for repeated calls."""

from __future__ import annotations

import statistics

import torch

from ostinato.tools.bench.ceilings import measure_ceilings

HBM_READ_BYTES_PER_S = measure_ceilings("cuda").read_bytes_per_s if torch.cuda.is_available() else float("nan")


def time_graph(fn, copies, iters=30):
    """Median µs per call of fn(0) .. fn(copies - 1) captured in one CUDA graph (warm-up run first, on a
    side stream, so that compilation and cuBLAS handles stay out of the capture)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def parse_attention_variants(specs):
    """['name:field=value,field=value', ...] -> {name: {field: int value}} (DecodeTuning fields)."""
    out = {}
    for spec in specs:
        name, _, body = spec.partition(":")
        out[name] = {k: int(v) for k, v in (item.split("=") for item in body.split(",") if item)}
    return out
