"""The GGUF kernels (kernels/gguf_gemv.py) against the bf16 projection (cuBLAS / the GEMV) on Llama-3.1-8B's
projection shapes, per type, at a few batch sizes: microseconds per call, GB/s of the bytes actually read (the
type's blocks and scales, or the bf16 weight) and that over the H200's measured HBM read bandwidth.

Timing as benchmarks/kernels/gemv.py: a CUDA graph over enough weight copies to defeat L2, median per call.
Each GGUF call is checked against the dequantized weight's F.linear (relative error printed).

    PYTHONPATH=src python3 benchmarks/kernels/gguf_linear.py [--types Q8_0 Q4_K Q6_K] [--batches 1 8 64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import HBM_READ_BYTES_PER_S, time_graph  # noqa: E402

from ostinato.kernels.gemv import small_batch_linear  # noqa: E402
from ostinato.kernels.gguf_linear import KERNEL_TYPES, GGUFLinear  # noqa: E402
from ostinato.kernels.pdl import pdl_unsupported_reason  # noqa: E402
from ostinato.tools.checkpoint_gguf import random_blocks  # noqa: E402

# Llama-3.1-8B: (name, N, K) of qkv, o, gate_up, down.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
BY_NAME = {v[0]: t for t, v in KERNEL_TYPES.items()}
L2_BYTES = 60 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pdl = pdl_unsupported_reason(torch.device("cuda")) is None
    rows = []
    for name, n, k in SHAPES:
        copies_bf16 = max(2, 2 * L2_BYTES // (n * k * 2) + 1)
        dense_layers = [torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
                        for _ in range(copies_bf16)]
        for m in args.batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            us = time_graph(lambda i: small_batch_linear(x, dense_layers[i], pdl=pdl), copies_bf16)
            rows.append(_row(name, m, "bf16", n * k * 2, us))
        for type_name in args.types:
            qtype = BY_NAME[type_name]
            blocks = torch.from_numpy(random_blocks(type_name, n, k, np.random.default_rng(0))).cuda()
            copies = max(2, 2 * L2_BYTES // blocks.numel() + 1)
            layers = [GGUFLinear(qtype, blocks.clone(), k) for _ in range(copies)]
            w = layers[0].dequantize().to(torch.bfloat16)
            for m in args.batches:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = F.linear(x, w).float()
                err = ((layers[0].linear(x, pdl=pdl).float() - ref).norm() / ref.norm()).item()
                us = time_graph(lambda i: layers[i].linear(x, pdl=pdl), copies)
                rows.append({**_row(name, m, type_name, layers[0].weight_bytes(), us), "rel_err": err})
    print("| projection | rows | type | us | GB/s | of HBM | rel. error |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['proj']} | {r['rows']} | {r['type']} | {r['us']:.1f} | {r['GBps']:.0f} | {r['of_hbm']:.2f} | "
              f"{r.get('rel_err', 0):.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _row(proj, m, type_name, nbytes, us):
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"proj": proj, "rows": m, "type": type_name, "us": us, "GBps": gbps,
            "of_hbm": gbps * 1e9 / HBM_READ_BYTES_PER_S}


if __name__ == "__main__":
    sys.exit(main())
