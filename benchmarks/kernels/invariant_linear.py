"""The batch-invariant projection (kernels/invariant_linear.py) at decode rows, its tilings swept, against
the default path (the GEMV / few-rows kernel / cuBLAS that `small_batch_linear` picks) on the real shapes.

Each variant is timed per projection and row count as benchmarks/kernels/small_gemm.py times cuBLAS (one CUDA graph
over enough weight copies to defeat L2, launched with PDL as the decode graph launches them), then summed over a
decode step's projections (4 a layer times the layers, plus the lm_head). Each variant is also checked for what it
is for: the rows of a 256-row call, computed again in calls of 1 to 130 rows (from several offsets), must be
bitwise equal ("invariance failures" counts the rows that are not). Variants: main's INVARIANT_TILES and its
neighbours, each with one field moved (`variants`).

    PYTHONPATH=src python3 benchmarks/kernels/invariant_linear.py [--shapes llama-3.1-8b,llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from small_gemm import SHAPES, projections  # noqa: E402
from timing import HBM_READ_BYTES_PER_S, time_graph  # noqa: E402

from ostinato.kernels.gemv import small_batch_linear  # noqa: E402
from ostinato.kernels.invariant_linear import INVARIANT_TILES, invariant_gemm  # noqa: E402
from ostinato.kernels.split_gemm import SplitTiles  # noqa: E402

LAYERS = {"qwen3-0.6b": 28, "llama-3.2-1b": 16, "llama-3.1-8b": 32}
CHECK_ROWS = (1, 5, 8, 16, 17, 33, 48, 64, 65, 130)
CHECK_CALL_ROWS = 256


def variants() -> dict[str, SplitTiles]:
    """main's tiles and its neighbours: each field moved one step."""
    base = INVARIANT_TILES
    changes = {
        "rows64": dict(min_row_tile=64),  # every row tile 64 wide, as at 64 rows
        "max_rows64": dict(max_row_tile=64),
        "no_prefetch": dict(prefetch_max_rows=0), "prefetch64": dict(prefetch_max_rows=64),
        "k64": dict(block_k=64, num_stages=3), "k256": dict(block_k=256, num_stages=3), "st4": dict(num_stages=4),
        "st5": dict(num_stages=5), "n32": dict(block_n=32), "n128": dict(block_n=128),
        "n128w8": dict(block_n=128, num_warps=8),  # two warpgroups: prefill's tiles twice as wide
        "sp128": dict(split_programs=128), "sp512": dict(split_programs=512), "minsplit2": dict(min_split_k_tiles=2),
    }
    return {"main": base, **{name: replace(base, **change) for name, change in changes.items()}}


def run(v: SplitTiles, x, w, out_dtype=None):
    return invariant_gemm(x, w, out_dtype=out_dtype, tiles=v, pdl=True)


def invariance_failures(v, w, k, out_dtype) -> int:
    """Rows of a CHECK_CALL_ROWS-row call that differ in any bit when computed again in smaller calls."""
    x = torch.randn(CHECK_CALL_ROWS, k, device="cuda", dtype=torch.bfloat16)
    full = run(v, x, w, out_dtype)
    bad = 0
    for rows in CHECK_ROWS:
        for start in (0, CHECK_CALL_ROWS - rows, (CHECK_CALL_ROWS - rows) // 2):
            part = run(v, x[start:start + rows].contiguous(), w, out_dtype)
            bad += int((part != full[start:start + rows]).any(dim=1).sum())
    return bad


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--variants", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    all_variants = variants()
    chosen = args.variants.split(",") if args.variants else list(all_variants)
    rows = []
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        totals: dict[tuple[str, int], float] = {}
        for proj, (n, k) in projections(shape).items():
            times = 1 if proj == "lm_head" else LAYERS[shape_name]
            out_dtype = torch.float32 if proj == "lm_head" else None
            wbytes = n * k * 2
            copies = max(2, min(32, -(-256 * 2**20 // wbytes)))
            layers = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
            weights = [torch.nn.init.normal_(layer.weight.requires_grad_(False), std=0.02) for layer in layers]
            for m in batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = torch.nn.functional.linear(x.float(), weights[0].float())
                entries = {"default": lambda i: small_batch_linear(x, layers[i], pdl=True) if out_dtype is None
                           else torch.mm(x, weights[i].t(), out_dtype=torch.float32)}
                for name in chosen:
                    v = all_variants[name]
                    entries[name] = lambda i, v=v: run(v, x, weights[i], out_dtype)
                for name, fn in entries.items():
                    try:
                        err = ((fn(0).float() - ref).abs().max() / ref.abs().max()).item()
                        us = time_graph(fn, copies)
                        bad = -1 if name == "default" or m != batches[0] else \
                            invariance_failures(all_variants[name], weights[0], k, out_dtype)
                    except Exception as exc:  # one failing variant must not end the sweep
                        print(f"{shape_name} {proj} M={m} {name}: FAILED {type(exc).__name__}: {exc}"[:400])
                        continue
                    totals[(name, m)] = totals.get((name, m), 0.0) + us * times
                    r = dict(shape=shape_name, proj=proj, M=m, N=n, K=k, variant=name, us=us, rel_err=err,
                             hbm_share=wbytes / us * 1e6 / HBM_READ_BYTES_PER_S, invariance_failures=bad)
                    rows.append(r)
                    print(f"{shape_name:13s} {proj:8s} M={m:<3d} {name:13s} {us:9.2f} us  "
                          f"{r['hbm_share'] * 100:5.1f}% HBM  err {err:.1e}"
                          + (f"  invariance failures {bad}" if bad >= 0 else ""), flush=True)
        print(f"## {shape_name}: projections of one decode step, us (x default)")
        for name in ["default"] + chosen:
            cells = []
            for m in batches:
                t, base = totals.get((name, m)), totals.get(("default", m))
                cells.append(f"M={m}: {t:9.1f} ({t / base:.3f}x)" if t and base else f"M={m}: -")
            print(f"## {shape_name:13s} {name:13s} " + "  ".join(cells), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
