"""FP8 projections (kernels/fp8_linear.py) against bf16 cuBLAS on the real projection shapes: the W8A16 GEMV (tiles
swept), the Triton tensor-core kernel (fp8_mma), torch._scaled_mm with per-token activation scales (the activation quantization included), and the path
kernels/fp8_linear.choose_fp8_path picks. The figures the rule should be read off.

Timing as benchmarks/kernels/gemv.py (a CUDA graph over enough weight copies to defeat L2, median per call); every
output is checked against F.linear(x, the dequantized W) in fp32 (relative error).

    PYTHONPATH=src python3 benchmarks/kernels/fp8_linear.py [--batches 1,4,16,64,256] [--json out.json]
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

from ostinato.kernels.fp8_linear import (Fp8Linear, Fp8Tiles, choose_fp8_path, fp8_gemv, fp8_mma,  # noqa: E402
                                         quantize_per_token, quantize_rows)


def gemv_tiles(m: int):
    m_pad = 1 << (m - 1).bit_length()
    for bn in (1, 2, 4, 8):
        for bk in (256, 512, 1024, 2048):
            if m_pad * bn * bk <= 16384 and bn * bk >= 512:
                yield Fp8Tiles(bn, bk)


def fp8_layers(n: int, k: int, copies: int) -> list[Fp8Linear]:
    layers = []
    for _ in range(copies):
        layer = Fp8Linear(k, n, False).cuda()
        q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        layers.append(layer)
    return layers


def scaled_mm(x, layer):
    xq, xs = quantize_per_token(x)
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale[None, :],
                            out_dtype=torch.bfloat16)


def _error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def measure(name: str, proj: str, n: int, k: int, batches: list[int], rows: list[dict]) -> None:
    copies = max(2, min(32, -(-256 * 2**20 // (n * k))))  # >= 256 MB of fp8 weights: reads come from HBM
    layers = fp8_layers(n, k, copies)
    dense = [layer.dequantize().to(torch.bfloat16) for layer in layers[:max(2, copies // 2)]]
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), layers[0].dequantize())
        row = {"shape": name, "proj": proj, "M": m, "N": n, "K": k,
               "bf16_us": time_graph(lambda i: F.linear(x, dense[i % len(dense)]), copies)}
        if m <= 64:
            best = None
            for tiles in gemv_tiles(m):
                us = time_graph(lambda i: fp8_gemv(x, layers[i].weight, layers[i].weight_scale, None, tiles), copies)
                if best is None or us < best[0]:
                    best = (us, tiles)
            row.update(gemv_us=best[0], gemv_block_n=best[1].block_n, gemv_block_k=best[1].block_k,
                       gemv_err=_error(fp8_gemv(x, layers[0].weight, layers[0].weight_scale, None, best[1]), ref))
        row.update(mma_us=time_graph(lambda i: fp8_mma(x, layers[i].weight, layers[i].weight_scale, None), copies),
                   mma_err=_error(fp8_mma(x, layers[0].weight, layers[0].weight_scale, None), ref),
                   scaled_mm_us=time_graph(lambda i: scaled_mm(x, layers[i]), copies),
                   scaled_mm_err=_error(scaled_mm(x, layers[0]), ref),
                   rule=str(choose_fp8_path(m, n, k, False, True)),
                   rule_us=time_graph(lambda i: layers[i].linear(x, pdl=False), copies))
        rows.append(row)
        fp8_floor_us = n * k / HBM_READ_BYTES_PER_S * 1e6
        gemv = f"gemv {row['gemv_us']:7.2f} us (bn {row['gemv_block_n']} bk {row['gemv_block_k']})" \
            if "gemv_us" in row else "gemv       -"
        print(f"{name:13s} {proj:8s} M={m:<4d} [{n:6d}x{k:5d}] bf16 {row['bf16_us']:7.2f} us  {gemv}  "
              f"mma {row['mma_us']:7.2f} us  scaled_mm {row['scaled_mm_us']:7.2f} us  rule {row['rule_us']:7.2f} us  fp8 floor "
              f"{fp8_floor_us:6.2f} us  err gemv {row.get('gemv_err', float('nan')):.1e} "
              f"scaled_mm {row['scaled_mm_err']:.1e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--batches", default="1,2,4,8,16,32,64,256")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    for name, shape in SHAPES.items():
        for proj, (n, k) in projections(shape).items():
            if proj != "lm_head":  # lm_head stays bf16 (model/fp8_weights.py)
                measure(name, proj, n, k, batches, rows)
                torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
