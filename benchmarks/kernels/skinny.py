"""The few-rows tensor-core linear (kernels/skinny.py) against cuBLAS on the real projection shapes, tiles
swept: us per call and share of HBM bandwidth, alone (no step around it).

Timing as benchmarks/kernels/small_gemm.py (a CUDA graph over enough weight copies to defeat L2, median per call).
Every variant's output is checked against F.linear in float32 (relative error printed; > 1e-2 fails the run).

    PYTHONPATH=src python3 benchmarks/kernels/skinny.py [--batches 4,16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from small_gemm import SHAPES, projections  # noqa: E402
from timing import HBM_READ_BYTES_PER_S, time_graph  # noqa: E402

from ostinato.kernels.skinny import SkinnyTiles, skinny_linear  # noqa: E402

TILINGS = [SkinnyTiles(16, 256, 4, 4), SkinnyTiles(16, 512, 4, 3), SkinnyTiles(32, 256, 4, 3),
           SkinnyTiles(16, 128, 4, 5), SkinnyTiles(32, 128, 4, 4), SkinnyTiles(64, 128, 4, 3),
           SkinnyTiles(64, 128, 8, 3), SkinnyTiles(32, 256, 8, 3)]


def name(t: SkinnyTiles) -> str:
    return f"{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="4,16")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    rows, failed = [], []
    for shape in args.shapes.split(","):
        for proj, (n, k) in projections(SHAPES[shape]).items():
            if proj == "lm_head":
                continue
            wbytes = n * k * 2
            copies = max(2, min(32, -(-256 * 2**20 // wbytes)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5 for _ in range(copies)]
            for m in map(int, args.batches.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x.float(), weights[0].float())
                cublas = time_graph(lambda i: F.linear(x, weights[i]), copies)
                results = []
                for tiles in TILINGS:
                    out = skinny_linear(x, weights[0], None, tiles)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    if not err < 1e-2:
                        failed.append((shape, proj, m, name(tiles), err))
                    us = time_graph(lambda i: skinny_linear(x, weights[i], None, tiles), copies)
                    results.append((us, tiles, err))
                    rows.append({"shape": shape, "proj": proj, "M": m, "N": n, "K": k, "tiles": name(tiles),
                                 "us": us, "cublas_us": cublas, "rel_err": err})
                pct = lambda us: 100 * wbytes / us * 1e6 / HBM_READ_BYTES_PER_S  # noqa: E731
                best = min(results, key=lambda r: r[0])
                print(f"{shape:13s} {proj:8s} M={m:2d} [{n:5d}x{k:5d}] cuBLAS {cublas:6.2f} us ({pct(cublas):5.1f}%)"
                      f"  best {best[0]:6.2f} ({pct(best[0]):5.1f}%) {name(best[1]):16s} x{cublas / best[0]:.2f}"
                      f" err {best[2]:.1e}", flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    for f in failed:
        print("WRONG", *f)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
