"""Triton small-M linear (kernels/gemv.py) against cuBLAS on the real projection shapes, tiles swept.

Timing as benchmarks/kernels/small_gemm.py (a CUDA graph over enough weight copies to defeat L2, median per call).
Each variant's output is checked against F.linear (relative error).

    PYTHONPATH=src python3 benchmarks/kernels/gemv.py [--json out.json]
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

from ostinato.kernels.gemv import GemvTiles, gemv_linear  # noqa: E402


def tile_grid(m_pad: int):
    for bn in (1, 2, 4, 8, 16):
        for bk in (128, 256, 512, 1024):
            if m_pad * bn * bk <= 8192 and bn * bk >= 512:
                for stages in (3,):
                    yield GemvTiles(bn, bk, 4, stages)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="1,2,4,8")
    args = ap.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        for proj, (n, k) in projections(shape).items():
            if proj == "lm_head":
                continue  # cuBLAS reads it at 95-100% of HBM bandwidth already (benchmarks/kernels/small_gemm.py)
            wbytes = n * k * 2
            copies = max(2, min(32, -(-256 * 2**20 // wbytes)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in map(int, args.batches.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x.float(), weights[0].float())
                cublas = time_graph(lambda i: F.linear(x, weights[i]), copies)
                best = None
                for tiles in tile_grid(triton_pad(m)):
                    out = gemv_linear(x, weights[0], None, tiles)
                    err = ((out.float() - ref).norm() / ref.norm()).item()
                    us = time_graph(lambda i: gemv_linear(x, weights[i], None, tiles), copies)
                    rows.append({"shape": name, "proj": proj, "M": m, "N": n, "K": k, "block_n": tiles.block_n,
                                 "block_k": tiles.block_k, "num_stages": tiles.num_stages, "us": us,
                                 "cublas_us": cublas, "rel_err": err})
                    if best is None or us < best[0]:
                        best = (us, tiles, err)
                us, tiles, err = best
                print(f"{name:13s} {proj:8s} M={m} [{n:6d}x{k:5d}] cuBLAS {cublas:7.2f} us "
                      f"({100 * wbytes / cublas * 1e6 / HBM_READ_BYTES_PER_S:5.1f}% HBM)  gemv best {us:7.2f} us "
                      f"({100 * wbytes / us * 1e6 / HBM_READ_BYTES_PER_S:5.1f}% HBM) bn {tiles.block_n} "
                      f"bk {tiles.block_k} st {tiles.num_stages} err {err:.1e}  x{cublas / us:.2f}", flush=True)
            del weights
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


def triton_pad(m: int) -> int:
    return 1 << (m - 1).bit_length()


if __name__ == "__main__":
    main()
