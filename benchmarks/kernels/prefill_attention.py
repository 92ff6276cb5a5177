"""Prefill attention alone on the GPU: a chunk of Q new tokens after C cached ones, at the
llama-3.1-8b attention shape (bf16, 32 q heads, 8 kv heads, head_dim 128, block 16).

For each (Q, C) point (one sequence; "96:8000+32x1:255" adds 32 one-token sequences at context 256, the
decode rows of a mixed step run in the same launch) it builds one KV pool per layer (32, so that reads come
from HBM as in a real step) with shuffled blocks, and times TritonPagedBackend.prefill over every layer:
  old     the one-pass kernel (_prefill_kernel in kernels/prefill_one_pass.py: split count forced to 1)
  new     what the backend now dispatches (the split kernel when plan_prefill splits, else the one-pass one)
  split1  the split kernel unsplit (it writes the output itself), to compare its tiles with the old kernel's
  shapes  the plan from shapes only (what a prefill captured in a CUDA graph uses: no host figures)
  --sweep also the split kernel's launch settings (block_m, block_n, num_warps, num_stages, programs_per_sm)
Figures: µs per layer as GPU time (the layers' calls captured in one CUDA graph, median replay / layers) and
as eager wall time (the way prefill runs today: launches included), achieved TFLOP/s over the causal FLOPs
(4 * head_dim * heads * sum over new tokens of the keys each sees), and max |out - torch reference| on the
first layer (TorchRefBackend: float32 SDPA).

    PYTHONPATH=src python3 benchmarks/kernels/prefill_attention.py [--sweep] [--points 96:8000,2016:6431]
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
from timing import time_graph  # noqa: E402

from ostinato.attention.base import AttentionMetadata  # noqa: E402
from ostinato.attention.torch_ref import TorchRefBackend  # noqa: E402
from ostinato.attention.triton_paged import TritonAttentionTuning, TritonPagedBackend  # noqa: E402
from ostinato.kernels.prefill_plan import PrefillSplitTuning  # noqa: E402
from ostinato.kernels.prefill_attention import paged_prefill_split, plan_for  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 32, 8, 128, 16
# The (Q, C) points of a long prompt's chunks beside decodes, one new token, and the 96-token chunk beside 32
# decode rows.
POINTS = "1:8000,96:0,96:4096,96:8000,224:8000,480:7967,2016:6431,96:8000+32x1:255"


def parse_point(point: str) -> list[tuple[int, int]]:
    """"96:8000" -> [(96, 8000)]; "96:8000+32x1:255" adds 32 sequences of 1 new token after 255 cached (the
    decode rows of a mixed step run as one-token prefills beside the chunk)."""
    seqs = []
    for part in point.split("+"):
        count, _, shape = part.rpartition("x")
        query_len, cached = (int(x) for x in shape.split(":"))
        seqs += [(query_len, cached)] * int(count or 1)
    return seqs


def make_inputs(seqs: list[tuple[int, int]]):
    """Per-layer paged caches holding every sequence's context in shuffled blocks, q for their new tokens,
    and the step's metadata with host figures. seqs: (new tokens, cached tokens) per sequence."""
    ctxs = [q + c for q, c in seqs]
    query_lens = [q for q, _ in seqs]
    gen = torch.Generator(device="cuda").manual_seed(sum(q * 10007 + c for q, c in seqs))
    nblks = [math.ceil(c / BLOCK) for c in ctxs]
    num_blocks = sum(nblks)  # + 1: the scratch block pads the tables
    caches = [tuple(torch.randn(num_blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", generator=gen,
                                dtype=torch.bfloat16) for _ in range(2)) for _ in range(LAYERS)]
    # the engine's table at max_model_len 8448 (benchmarks/step/mixed_step.py)
    width = max([math.ceil(8448 / BLOCK)] + nblks)
    tables = torch.full((len(seqs), width), num_blocks, dtype=torch.int32, device="cuda")
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    used = 0
    for s, n in enumerate(nblks):
        tables[s, :n] = perm[used:used + n]
        used += n
    q = torch.randn(sum(query_lens), HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        is_prefill=True, slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64, device="cuda"),
        block_tables=tables, context_lens=torch.tensor(ctxs, dtype=torch.int32, device="cuda"),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device="cuda"), query_lens=query_lens,
        context_lens_host=ctxs, max_query_len=max(query_lens), max_context_len=max(ctxs))
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


def causal_flops(seqs: list[tuple[int, int]]) -> float:
    # Per sequence, the sum over new token i of the keys it sees: cached + i + 1.
    keys_seen = sum(q * (c + 1) + q * (q - 1) / 2 for q, c in seqs)
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


def measure_point(point: str, sweep: bool) -> dict:
    """variant name -> (µs per layer, split count, max abs diff), printing a line for each."""
    scale = HEAD_DIM ** -0.5
    seqs = parse_point(point)
    caches, q, meta = make_inputs(seqs)
    ref = TorchRefBackend().prefill(q, caches[0][0], caches[0][1], meta, scale).float()
    flops = causal_flops(seqs)
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
            print(f"{point:18s} {name:20s} failed: {type(e).__name__}: {e}"[:300])
            continue
        row[name] = (us, plan.splits, diff)
        kernel = "one-pass" if dispatched and plan.splits == 1 else f"split {plan.splits:2d} bq {plan.block_q:3d}"
        print(f"{point:18s} {name:20s} {kernel:15s} "
              f"{us:9.1f} us/layer (eager {eager:9.1f}) {flops / us / 1e6:6.1f} TFLOP/s "
              f"max|diff| {diff:.2e}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--points", default=POINTS,
                    help="Q:C (new tokens : cached tokens), comma-separated; '+Nx1:255' adds N one-token rows")
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    table = []
    print(f"{torch.cuda.get_device_name()}; llama-3.1-8b attention shape, {LAYERS} layers, bf16")
    for point in args.points.split(","):
        table.append((point, causal_flops(parse_point(point)), measure_point(point, args.sweep)))
        torch.cuda.empty_cache()
    print("\n| chunk Q:cached C | old µs/layer | new µs/layer (splits) | speedup | old TFLOP/s | new TFLOP/s "
          "| split kernel unsplit µs | max abs diff old / new |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for point, flops, row in table:
        (old, _, d_old), (new, splits, d_new), (unsplit, _, _) = row["old"], row["new"], row["split1"]
        print(f"| {point} | {old:.1f} | {new:.1f} ({splits}) | {old / new:.1f}x | {flops / old / 1e6:.0f} | "
              f"{flops / new / 1e6:.0f} | {unsplit:.1f} | {d_old:.1e} / {d_new:.1e} |")

if __name__ == "__main__":
    main()
