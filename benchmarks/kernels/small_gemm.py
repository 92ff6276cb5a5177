"""cuBLAS (F.linear) at decode batch sizes on the real projection shapes: µs per call and HBM share.

Each (projection, M) is timed as a CUDA graph of one call per layer copy, over enough distinct weight
copies that they do not fit in L2 (>= 256 MB), median replay / calls. Bytes = the weight (plus the
activations, negligible at small M). Also the lm_head with float32 output straight from the GEMM
(torch.mm(..., out_dtype=torch.float32)) against bf16 output and against bf16 then .float().

    PYTHONPATH=src python3 benchmarks/kernels/small_gemm.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import HBM_READ_BYTES_PER_S, time_graph  # noqa: E402
SHAPES = {  # hidden, intermediate, vocab, heads, kv heads, head_dim
    "qwen3-0.6b": (1024, 3072, 151936, 16, 8, 128),
    "llama-3.2-1b": (2048, 8192, 128256, 32, 8, 64),
    "llama-3.1-8b": (4096, 14336, 128256, 32, 8, 128),
}


def projections(shape):
    hidden, inter, vocab, heads, kv, dim = shape
    return {"qkv": ((heads + 2 * kv) * dim, hidden), "o": (hidden, heads * dim),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter), "lm_head": (vocab, hidden)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="1,4,8,16,64")
    args = ap.parse_args()
    rows = []
    for name, shape in SHAPES.items():
        for proj, (n, k) in projections(shape).items():
            wbytes = n * k * 2
            copies = max(2, min(32, -(-256 * 2**20 // wbytes)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
            for m in map(int, args.batches.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                variants = {"bf16": lambda i: F.linear(x, weights[i])}
                if proj == "lm_head":
                    variants["fp32_out"] = lambda i: torch.mm(x, weights[i].t(), out_dtype=torch.float32)
                    variants["bf16_then_float"] = lambda i: F.linear(x, weights[i]).float()
                for vname, fn in variants.items():
                    try:
                        us = time_graph(fn, copies)
                    except Exception as exc:  # report and go on: one unsupported variant must not end the run
                        print(f"{name} {proj} M={m} {vname}: FAILED {type(exc).__name__}: {exc}"[:300])
                        continue
                    r = {"shape": name, "proj": proj, "M": m, "N": n, "K": k, "variant": vname, "us": us,
                         "GBps": wbytes / us / 1e3, "hbm_share": wbytes / us * 1e6 / HBM_READ_BYTES_PER_S}
                    rows.append(r)
                    print(f"{name:13s} {proj:8s} M={m:3d} [{n:6d}x{k:5d}] {vname:15s} {us:8.2f} us "
                          f"{r['GBps']:6.0f} GB/s {100 * r['hbm_share']:5.1f}% HBM", flush=True)
            del weights
            torch.cuda.empty_cache()
    # fp32 output from the bf16 GEMM: the same products, accumulated in fp32, without the bf16 rounding
    x = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)
    ref = x.double() @ w.double().t()
    fp32 = torch.mm(x, w.t(), out_dtype=torch.float32)
    bf16 = F.linear(x, w)
    print(f"lm_head numerics: |fp32_out - fp64| max {(fp32.double() - ref).abs().max().item():.2e}, "
          f"|bf16 - fp64| max {(bf16.double() - ref).abs().max().item():.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
