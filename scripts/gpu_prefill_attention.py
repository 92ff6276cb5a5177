"""Prefill attention alone on the GPU (issue 12): a chunk of Q new tokens after C cached ones, at the
llama-3.1-8b attention shape (bf16, 32 q heads, 8 kv heads, head_dim 128, block 16).

For each (Q, C) point it builds one KV pool per layer (32, so that reads come from HBM as in a real step)
with shuffled blocks, and times TritonPagedBackend.prefill over every layer:
  old     the one-pass kernel (_prefill_kernel in attention/triton_paged.py: split count forced to 1)
  new     what the backend now dispatches (the split kernel when plan_prefill splits, else the one-pass one)
  split1  the split kernel unsplit (it writes the output itself), to compare its tiles with the old kernel's
  shapes  the plan from shapes only (as a prefill captured in a CUDA graph would use), when it differs
  --sweep also the split kernel's launch settings (block_m, block_n, num_warps, num_stages, programs_per_sm)
Figures: µs per layer as GPU time (the layers' calls captured in one CUDA graph, median replay / layers) and
as eager wall time (the way prefill runs today: launches included), achieved TFLOP/s over the causal FLOPs
(4 * head_dim * heads * sum over new tokens of the keys each sees), and max |out - torch reference| on the
first layer (TorchRefBackend: float32 SDPA).

    PYTHONPATH=src python3 scripts/gpu_prefill_attention.py [--sweep] [--points 96:8000,2016:6431]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_timing import time_graph  # noqa: E402

from ostinato.attention.base import AttentionMetadata  # noqa: E402
from ostinato.attention.torch_ref import TorchRefBackend  # noqa: E402
from ostinato.attention.triton_paged import TritonAttentionTuning, TritonPagedBackend  # noqa: E402
from ostinato.attention.prefill_split_plan import PrefillSplitTuning  # noqa: E402
from ostinato.attention.triton_prefill_split import paged_prefill_split, plan_for  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 8, 128, 16
POINTS = "1:8000,96:0,96:4096,96:8000,224:8000,480:7967,2016:6431"  # docs' table of issue 12, plus Q=1


def make_inputs(query_len: int, cached: int, host_figures: bool = True):
    ctx = cached + query_len
    gen = torch.Generator(device="cuda").manual_seed(query_len * 10007 + cached)
    nblk = math.ceil(ctx / BLOCK)
    caches = [(torch.randn(nblk + 1, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16),
               torch.randn(nblk + 1, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    width = math.ceil(8448 / BLOCK)  # the engine's table at max_model_len 8448 (scripts/gpu_mixed_step.py)
    tables = torch.full((1, width), nblk, dtype=torch.int32, device="cuda")
    tables[0, :nblk] = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32)
    q = torch.randn(query_len, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(query_len, dtype=torch.int64, device="cuda"),
        block_tables=tables, context_lens=torch.tensor([ctx], dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor([0, query_len], dtype=torch.int32, device="cuda"),
        query_lens=[query_len] if host_figures else None, context_lens_host=[ctx] if host_figures else None,
        max_query_len=query_len, max_context_len=ctx)
    return caches, q, meta


def eager_us(fn, copies: int, iters: int = 10) -> float:
    for i in range(copies):
        fn(i)
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(copies):
            fn(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return statistics.median(times)


def causal_flops(query_len: int, cached: int) -> float:
    keys_seen = query_len * (cached + 1) + query_len * (query_len - 1) / 2  # sum over i of cached + i + 1
    return 4.0 * HEAD_DIM * HEADS * keys_seen


def variants(sweep: bool) -> dict:
    """name -> (call(q, k_cache, v_cache, meta, scale), its split tuning, whether the backend dispatches)."""
    def backend(**split):
        b = TritonPagedBackend(TritonAttentionTuning(prefill_split=PrefillSplitTuning(**split)))
        return b.prefill, b.tuning.prefill_split, True

    def split_kernel(tuning: PrefillSplitTuning):
        def call(q, k_cache, v_cache, meta, scale):
            plan = plan_for(tuning, q, k_cache, meta, HEADS // KV_HEADS)
            return paged_prefill_split(q, k_cache, v_cache, meta, scale, HEADS // KV_HEADS, tuning, plan)
        return call, tuning, False

    out = {"old": backend(splits=1), "new": backend(), "split1": split_kernel(PrefillSplitTuning(splits=1))}
    if sweep:
        for bm in (64, 128):
            for bn in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        t = PrefillSplitTuning(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages)
                        out[f"bm{bm}_bn{bn}_w{warps}_s{stages}"] = split_kernel(t)
        for pps in (2, 8):
            out[f"pps{pps}"] = split_kernel(PrefillSplitTuning(programs_per_sm=pps))
    return out


def measure_point(query_len: int, cached: int, sweep: bool) -> dict:
    """variant name -> (µs per layer, split count, max abs diff), printing a line for each."""
    scale = HEAD_DIM ** -0.5
    caches, q, meta = make_inputs(query_len, cached)
    ref = TorchRefBackend().prefill(q, caches[0][0], caches[0][1], meta, scale).float()
    flops = causal_flops(query_len, cached)
    shapes_meta = dataclasses.replace(meta, query_lens=None, context_lens_host=None)
    runs = list(variants(sweep).items())
    runs.insert(2, ("shapes", (TritonPagedBackend().prefill, PrefillSplitTuning(), True)))
    row = {}
    for name, (call, tuning, dispatched) in runs:
        m = shapes_meta if name == "shapes" else meta
        plan = plan_for(tuning, q, caches[0][0], m, HEADS // KV_HEADS)
        try:
            diff = (call(q, caches[0][0], caches[0][1], m, scale).float() - ref).abs().max().item()
            us = time_graph(lambda i: call(q, caches[i][0], caches[i][1], m, scale), LAYERS)
            eager = eager_us(lambda i: call(q, caches[i][0], caches[i][1], m, scale), LAYERS)
        except Exception as e:  # a sweep setting may not compile (shared memory, registers): skip it
            if name in ("old", "new", "split1"):
                raise
            print(f"Q {query_len:5d} C {cached:5d} {name:20s} failed: {type(e).__name__}: {e}"[:300])
            continue
        row[name] = (us, plan.splits, diff)
        kernel = "one-pass" if dispatched and plan.splits == 1 else f"split {plan.splits:2d} bq {plan.block_q:3d}"
        print(f"Q {query_len:5d} C {cached:5d} {name:20s} {kernel:15s}"
              f"{us:9.1f} us/layer (eager {eager:9.1f}) {flops / us / 1e6:6.1f} TFLOP/s "
              f"max|diff| {diff:.2e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=POINTS, help="Q:C pairs (new tokens : cached tokens)")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    table = []
    print(f"{torch.cuda.get_device_name()}; llama-3.1-8b attention shape, {LAYERS} layers, bf16")
    for point in args.points.split(","):
        query_len, cached = (int(x) for x in point.split(":"))
        table.append((query_len, cached, causal_flops(query_len, cached), measure_point(query_len, cached, args.sweep)))
        torch.cuda.empty_cache()
    print("\n| chunk Q | cached C | old µs/layer | new µs/layer (splits) | speedup | old TFLOP/s | new TFLOP/s "
          "| split kernel unsplit µs | max abs diff old / new |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for query_len, cached, flops, row in table:
        (old, _, d_old), (new, splits, d_new), (unsplit, _, _) = row["old"], row["new"], row["split1"]
        print(f"| {query_len} | {cached} | {old:.1f} | {new:.1f} ({splits}) | {old / new:.1f}x | "
              f"{flops / old / 1e6:.0f} | {flops / new / 1e6:.0f} | {unsplit:.1f} | {d_old:.1e} / {d_new:.1e} |")


if __name__ == "__main__":
    main()
