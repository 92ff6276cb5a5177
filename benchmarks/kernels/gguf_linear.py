"""The GGUF kernels (kernels/gguf_gemv.py, kernels/gguf_int8_dot.py) against the bf16 projection (cuBLAS / the GEMV)
on Llama-3.1-8B's projection shapes, per type, at a few batch sizes: microseconds per call, GB/s of the bytes
actually read (the type's blocks and scales, or the bf16 weight) and that over the HBM read bandwidth measured here.

Timing as benchmarks/kernels/gemv.py: a CUDA graph over enough weight copies to defeat L2, median per call.
Each GGUF call is checked against the dequantized weight's F.linear (relative error printed). The rows "TYPE" take
gguf_linear_into's default path; beside them, above GEMV_MAX_ROWS "TYPE fused" (the tensor-core GEMM that decodes
in the kernel) where the default is dense slices and cuBLAS, "TYPE dense slices" above GEMV_MAX_ROWS where the
default is an MMA kernel (int8, or W decoded to x's dtype); for Q4_K / Q6_K / Q8_0 "TYPE decoded to fp32" where the
default is dp4a dot products (gguf_int8_dot.INT8_DOT_ROWS), "TYPE int8 dot" at the other rows up to GEMV_MAX_ROWS,
and "TYPE int8 mma" (kernels/gguf_int8_mma.py) from 2 rows where it is not the default.
--sweep instead times each candidate tile setting over the four projections and prints, per type and batch, the
settings by total time beside the default path's own: the table choose_tiles and the int8-dot tiles are read off.

    PYTHONPATH=src python3 benchmarks/kernels/gguf_linear.py [--types Q8_0 Q4_K Q6_K] [--batches 1 8 64] [--json F]
    PYTHONPATH=src python3 benchmarks/kernels/gguf_linear.py --sweep --types Q4_K Q6_K Q8_0 --batches 1 8 64
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
from ostinato.kernels.gguf_gemv import (GEMV_MAX_ROWS, GROUPING, GGUFTiles, choose_tiles,  # noqa: E402
                                        gguf_linear_into, gguf_matmul_dequantized)
from ostinato.kernels.gguf_int8_mma import MmaTiles  # noqa: E402
from ostinato.kernels.gguf_int8_route import INT8_DOT_KERNELS, takes_half_mma, takes_int8_mma  # noqa: E402
from ostinato.kernels.gguf_int8_dot import int8_dot_applies  # noqa: E402
from ostinato.kernels.gguf_int8_q4k import Q4kTiles  # noqa: E402
from ostinato.kernels.gguf_int8_q6k_q80 import Q6kTiles, Q8Tiles, q6k_tiles, q8_tiles  # noqa: E402
from ostinato.kernels.gguf_linear import (KERNEL_TYPES, Q4_K, Q6_K, Q8_0, GGUFLinear,  # noqa: E402
                                          dequantize_blocks, device_rows, file_rows)
from ostinato.kernels.pdl import pdl_unsupported_reason  # noqa: E402
from ostinato.tools.checkpoint_gguf import random_blocks  # noqa: E402

INT8_TILES = {qtype: tiles() for qtype, (tiles, _) in INT8_DOT_KERNELS.items()}  # their default tiles


def int8_tiles(qtype: int, m: int):
    """The integer-dot kernel's default tiles at m rows (Q6_K's and Q8_0's differ at one row)."""
    return {Q8_0: q8_tiles, Q6_K: q6k_tiles}.get(qtype, lambda _: INT8_TILES[qtype])(m)


# Llama-3.1-8B: (name, N, K) of qkv, o, gate_up, down.
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
# The other shapes a Q4_K_M file gives its kernels: q and k without v where v is Q6_K, v alone, the lm_head.
MORE_SHAPES = {"qk": ("qk", 5120, 4096), "v": ("v", 1024, 4096), "head": ("head", 128256, 4096)}
BY_NAME = {v[0]: t for t, v in KERNEL_TYPES.items()}
L2_BYTES = 60 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="time candidate tile settings instead")
    ap.add_argument("--shapes", nargs="+", default=[s[0] for s in SHAPES], choices=[s[0] for s in SHAPES] +
                    list(MORE_SHAPES), help="--sweep: the projections summed (each one's own best is printed too)")
    args = ap.parse_args()
    pdl = pdl_unsupported_reason(torch.device("cuda")) is None
    if args.sweep:
        shapes = [next(s for s in SHAPES if s[0] == name) if name not in MORE_SHAPES else MORE_SHAPES[name]
                  for name in args.shapes]
        return sweep(args.types, args.batches, pdl, shapes)
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
                rows += _beside_default(name, m, type_name, layers, x, ref, pdl)
    print("| projection | rows | type | us | GB/s | of HBM | rel. error |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['proj']} | {r['rows']} | {r['type']} | {r['us']:.1f} | {r['GBps']:.0f} | {r['of_hbm']:.2f} | "
              f"{r.get('rel_err', 0):.1e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _beside_default(name, m, type_name, layers, x, ref, pdl) -> list[dict]:
    """The other paths worth timing beside the default one at m rows (the module's docstring)."""
    qtype = layers[0].qtype
    n, k = layers[0].out_features, x.shape[1]
    own = choose_tiles(qtype, m, n, k)
    out = []
    if m > GEMV_MAX_ROWS and (takes_int8_mma(x, qtype) or takes_half_mma(x, qtype)):
        out.append(_dense_row(name, m, type_name, layers, x, ref))
    elif takes_int8_mma(x, qtype):
        out.append(_tiles_row(name, m, type_name, layers, x, ref, pdl, int8_tiles(qtype, m), " int8 dot"))
    elif m > GEMV_MAX_ROWS:
        out.append(_tiles_row(name, m, type_name, layers, x, ref, pdl, own, " fused"))
    elif int8_dot_applies(x, qtype):
        out.append(_tiles_row(name, m, type_name, layers, x, ref, pdl, own, " decoded to fp32"))
    elif qtype in INT8_TILES:  # the integer-dot kernels where they are not (yet) the default
        out.append(_tiles_row(name, m, type_name, layers, x, ref, pdl, int8_tiles(qtype, m), " int8 dot"))
    if qtype in INT8_TILES and m > 1 and not takes_int8_mma(x, qtype):
        out.append(_tiles_row(name, m, type_name, layers, x, ref, pdl, MmaTiles(), " int8 mma"))
    return out


def _dense_row(name, m, type_name, layers, x, ref) -> dict:
    """The dense slices (W decoded into a bf16 scratch a slice at a time, then cuBLAS) where they are not the
    default."""
    n = layers[0].out_features
    out = torch.empty(m, n, device="cuda", dtype=x.dtype)
    gguf_matmul_dequantized(x, layers[0].blocks, layers[0].qtype, None, out)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    us = time_graph(lambda i: gguf_matmul_dequantized(x, layers[i].blocks, layers[i].qtype, None, out), len(layers))
    return {**_row(name, m, f"{type_name} dense slices", layers[0].weight_bytes(), us), "rel_err": err}


def _tiles_row(name, m, type_name, layers, x, ref, pdl, tiles, what) -> dict:
    """A kernel at given tiles beside the default path: above GEMV_MAX_ROWS the tensor-core GEMM that decodes
    inside the kernel (the default: dense slices); where integer dot products are the default, the GEMV that
    decodes each weight to fp32; where they are not, the integer-dot kernels."""
    n = layers[0].out_features
    out = torch.empty(m, n, device="cuda", dtype=x.dtype)
    gguf_linear_into(x, layers[0].blocks, layers[0].qtype, None, out, pdl, tiles)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    us = time_graph(lambda i: gguf_linear_into(x, layers[i].blocks, layers[i].qtype, None, out, pdl, tiles),
                    len(layers))
    return {**_row(name, m, f"{type_name}{what}", layers[0].weight_bytes(), us), "rel_err": err}


def candidates(qtype: int, m: int) -> list[GGUFTiles]:
    """Tile settings worth timing at m rows: GEMV ones (block_n rows of W, weights of a row per K step, 4 or 8
    warps) up to GEMV_MAX_ROWS, tensor-core ones (64 or 128 columns of K a step) from GEMV_MAX_ROWS on."""
    group_k, piece, _ = GROUPING[qtype]
    out = []
    if m == 1 and qtype == Q4_K:
        out += [Q4kTiles(bn, bj, warps) for bn in (4, 8, 16) for bj in (128, 256, 512) for warps in (4, 8)]
    if m == 1 and qtype == Q6_K:
        out += [Q6kTiles(bn, bj, warps) for bn in (2, 4, 8) for bj in (64, 128, 256) for warps in (4, 8)]
    if 1 < m <= GEMV_MAX_ROWS and qtype == Q4_K:
        out += [Q4kTiles(bn, bj) for bn in (2, 4, 8) for bj in (128, 256)]
    if 1 < m <= GEMV_MAX_ROWS and qtype == Q6_K:
        out += [Q6kTiles(bn, bj) for bn in (1, 2, 4) for bj in (32, 64)]
    if m <= GEMV_MAX_ROWS and qtype == Q8_0:
        out += [Q8Tiles(bn, bj, warps) for bn in (2, 4, 8) for bj in (128, 256, 512) for warps in (4, 8)]
    if m == 1:
        out += [GGUFTiles(1, bn, step // group_k, warps) for bn in (2, 4, 8) for step in (1024, 2048)
                for warps in (4, 8)]
    elif m <= GEMV_MAX_ROWS:
        out += [GGUFTiles(triton_pow2(m), bn, step // group_k, warps) for bn in (2, 4) for step in (256, 512)
                for warps in (4, 8)]
    if m == GEMV_MAX_ROWS:
        out += [GGUFTiles(16, bn, max(1, step // piece)) for bn in (64, 128) for step in (64, 128)]
    elif m > GEMV_MAX_ROWS:
        out += [GGUFTiles(bm, bn, max(1, 64 // piece), warps) for bm in (32, 64) for bn in (64, 128)
                for warps in (4, 8)]
    return out


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


def sweep(types: list[str], batches: list[int], pdl: bool, shapes: list[tuple[str, int, int]]) -> int:
    for type_name in types:
        qtype = BY_NAME[type_name]
        layers = []
        for _, n, k in shapes:
            blocks = torch.from_numpy(random_blocks(type_name, n, k, np.random.default_rng(0))).cuda()
            copies = max(2, 2 * L2_BYTES // blocks.numel() + 1)
            layers.append((n, k, [device_rows(blocks, qtype).clone() for _ in range(copies)]))
        nbytes = sum(copies[0].numel() for _, _, copies in layers)
        for m in batches:
            n0, k0, copies0 = layers[0]
            x0 = torch.randn(m, k0, device="cuda", dtype=torch.bfloat16)
            default = int8_tiles(qtype, m) if int8_dot_applies(x0, qtype) else choose_tiles(qtype, m, n0, k0)
            results = []
            w0 = dequantize_blocks(file_rows(copies0[0], qtype), qtype, k0)
            ref = F.linear(x0, w0.to(torch.bfloat16)).float()
            for tiles in candidates(qtype, m) + [default]:
                try:
                    out0 = torch.empty(m, n0, device="cuda", dtype=torch.bfloat16)
                    gguf_linear_into(x0, copies0[0], qtype, None, out0, pdl, tiles)
                    err = ((out0.float() - ref).norm() / ref.norm()).item()
                    each = [_time_tiles(qtype, m, n, k, copies, tiles, pdl) for n, k, copies in layers]
                except Exception as e:  # a setting the compiler refuses (registers, shared memory): skip it
                    print(f"{type_name} rows {m} {tiles}: failed, {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                total = sum(each)
                results.append((total, tiles, each))
                print(f"{type_name} rows {m} {tiles}: {total:.1f} us for the {len(each)} projections "
                      f"({' / '.join(f'{us:.1f}' for us in each)}), rel. error {err:.1e}"
                      f"{'' if err < 2e-2 else '  WRONG'}", flush=True)
            results.sort(key=lambda r: r[0])
            print(f"## {type_name} rows {m}: choose_tiles {default} -> "
                  f"{[r[0] for r in results if r[1] == default][0]:.1f} us; best:")
            for total, tiles, _ in results[:4]:
                print(f"   {total:7.1f} us  {nbytes / (total * 1e-6) / HBM_READ_BYTES_PER_S:.2f} of HBM  {tiles}")
            _print_per_shape(results, default, shapes, layers)
    return 0


def _print_per_shape(results, default, shapes, layers) -> None:
    """Each projection's fastest setting beside the default's time on it."""
    own = [r for r in results if r[1] == default][0][2]
    for i, ((name, n, k), (_, _, copies)) in enumerate(zip(shapes, layers)):
        us, tiles = min(((r[2][i], r[1]) for r in results), key=lambda t: t[0])
        hbm = copies[0].numel() / (us * 1e-6) / HBM_READ_BYTES_PER_S
        print(f"   {name} {n}x{k}: best {us:.1f} us ({hbm:.2f} of HBM) {tiles}; default {own[i]:.1f} us")


def _time_tiles(qtype, m, n, k, copies, tiles, pdl):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    return time_graph(lambda i: gguf_linear_into(x, copies[i], qtype, None, out, pdl, tiles), len(copies))


def _row(proj, m, type_name, nbytes, us):
    gbps = nbytes / (us * 1e-6) / 1e9
    return {"proj": proj, "rows": m, "type": type_name, "us": us, "GBps": gbps,
            "of_hbm": gbps * 1e9 / HBM_READ_BYTES_PER_S}


if __name__ == "__main__":
    sys.exit(main())
