"""FP8 projections (kernels/fp8_linear.py) swept against bf16 on the real projection shapes: GB/s of weight read per
candidate config, beside bf16 cuBLAS (F.linear) and, at one row, the bf16 GEMV the engine uses there.

Candidates: the streaming W8A16 GEMV (kernels/fp8_stream.py, 1-4 rows) over tiles and prefetch depths; the first
W8A16 GEMV (kernels/fp8_gemv.py) over tiles, K tiles a step and warps; the W8A8 few-rows kernel
(kernels/fp8_w8a8.py, its activation quantization included) over tiles; the Triton tensor-core kernel
(kernels/fp8_mma.py) over tiles; the W8A16 split GEMM (kernels/split_gemm.py) over tiles;
torch._scaled_mm after the one-kernel per-token quantization, after the
torch-ops quantization it replaced, and alone (the quantization's share); and what choose_fp8_path picks (`rule`).
At the end, the best config per (projection, rows) as entries for kernels/fp8_linear.FP8_MEASURED, where they go
if they beat the rule.

Timing as benchmarks/kernels/gemv.py (a CUDA graph over enough weight copies to defeat L2, median per call, no
PDL on either side); every output is checked against F.linear(x, the dequantized W) in fp32 (relative error;
a config over 5e-2 is reported and never picked). Default: the 8B's qkv, o, gate_up and down at 1, 16 and 64
rows, about a minute on an H200, most of it Triton compiling:

    PYTHONPATH=src python3 benchmarks/kernels/fp8_linear.py [--shapes llama-3.1-8b] [--batches 1,16,64] \
        [--json out.json]
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

from ostinato.kernels.fp8_linear import (Fp8Linear, Fp8Tiles, MmaTiles, SplitTiles, SplitW8a8,  # noqa: E402
                                         StreamTiles, W8a8Tiles, choose_fp8_path, fp8_gemv, fp8_mma, fp8_stream,
                                         fp8_w8a8, quantize_per_token, quantize_rows, quantize_tokens, split_gemm)
from ostinato.kernels.gemv import choose_gemv_tiles, gemv_linear  # noqa: E402

ERROR_LIMIT = 5e-2  # _scaled_mm rounds x to E4M3 too; the W8A16 kernels stay near 4e-3 (bf16 output)

GEMV_ONE_ROW = [Fp8Tiles(8, 1024), Fp8Tiles(8, 1024, k_tiles=2), Fp8Tiles(4, 1024, k_tiles=2),
                Fp8Tiles(8, 512, k_tiles=2), Fp8Tiles(16, 512, k_tiles=2), Fp8Tiles(8, 2048, num_warps=8),
                Fp8Tiles(8, 1024, num_warps=8, k_tiles=2), Fp8Tiles(8, 1024, k_tiles=2, num_stages=1)]
STREAM = [StreamTiles(bn, bk, prefetch=p) for bn, bk in ((4, 1024), (8, 1024), (16, 512), (4, 2048), (8, 2048))
          for p in (1, 2)] + [StreamTiles(bn, bk, num_warps=8) for bn, bk in ((16, 1024), (8, 2048), (16, 2048))]
STREAM_ROWS = [StreamTiles(2, 2048), StreamTiles(4, 2048), StreamTiles(4, 1024), StreamTiles(4, 1024, prefetch=2),
               StreamTiles(8, 1024)]
GEMV_ROWS = [Fp8Tiles(1, 512), Fp8Tiles(2, 512, num_warps=8, k_tiles=2)]
MMA_FEW_ROWS = [MmaTiles(16, 32, 256), MmaTiles(16, 64, 256), MmaTiles(16, 128, 128)]
MMA_ROWS = [MmaTiles(64, 64, 128), MmaTiles(64, 128, 128), MmaTiles(32, 64, 256)]
W8A8 = [W8a8Tiles(16, 512), W8a8Tiles(16, 256), W8a8Tiles(32, 256), W8a8Tiles(32, 512), W8a8Tiles(64, 256)]
# FP8 K tiles of 128 bytes (block_k 128) hold half the bytes of the bf16 invariant GEMM's; 256 restores them.
SPLIT = [SplitTiles(), SplitTiles(block_k=256), SplitTiles(block_k=256, num_stages=4),
         SplitTiles(block_k=256, split_programs=512), SplitTiles(block_n=128, block_k=128, num_warps=8),
         SplitTiles(block_k=256, prefetch_max_rows=64)]
# W8A8: FP8 K tiles of 128 and 256 bytes, 64- and 128-row weight tiles, a wave of 256 or 512 programs.
SPLIT_W8A8 = [SplitW8a8(t) for t in (
    SplitTiles(), SplitTiles(block_k=256), SplitTiles(block_k=256, split_programs=512),
    SplitTiles(block_n=128, block_k=128, num_warps=8), SplitTiles(block_n=128, block_k=256, num_warps=8),
    SplitTiles(block_k=256, num_stages=4), SplitTiles(block_k=256, split_programs=128))]


def candidates(m: int, kernels: tuple[str, ...] = ()):
    """(name, config) for what may compute m rows; config is what FP8_MEASURED would hold, or None. kernels:
    only the candidates whose names start with one of these (stream, gemv, w8a8, split, split_w8a8, mma,
    scaled_mm); all if empty."""
    for name, config in _all_candidates(m):
        if not kernels or name.startswith(kernels):
            yield name, config


def _all_candidates(m: int):
    gemv = GEMV_ONE_ROW if m == 1 else GEMV_ROWS if m <= 16 else []
    mma = MMA_FEW_ROWS if m <= 16 else MMA_ROWS
    stream = STREAM if m == 1 else STREAM_ROWS if m <= 4 else []
    yield from ((f"stream bn{t.block_n} bk{t.block_k} p{t.prefetch} w{t.num_warps}", t) for t in stream)
    yield from ((f"gemv bn{t.block_n} bk{t.block_k} kt{t.k_tiles} w{t.num_warps} s{t.num_stages}", t) for t in gemv)
    yield from ((f"w8a8 bn{t.block_n} bk{t.block_k} w{t.num_warps} s{t.num_stages} (+quant)", t) for t in W8A8)
    yield from ((f"split bn{t.block_n} bk{t.block_k} w{t.num_warps} s{t.num_stages} sp{t.split_programs} "
                 f"pf{t.prefetch_max_rows}", t) for t in SPLIT)
    yield from ((f"split_w8a8 bn{t.tiles.block_n} bk{t.tiles.block_k} w{t.tiles.num_warps} s{t.tiles.num_stages} "
                 f"sp{t.tiles.split_programs} (+quant)", t) for t in SPLIT_W8A8 if m > 1)
    if m > 1:  # the default tiles without the activations' quantization: its share
        yield "split_w8a8 default alone (x quantized before)", None
    if m > 1:
        yield from ((f"mma {t.block_m}x{t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}", t) for t in mma)
        yield "scaled_mm (one-kernel quant)", "scaled_mm"
        yield "scaled_mm (torch-ops quant)", None
        yield "scaled_mm alone (x quantized before)", None


def fp8_layers(n: int, k: int, copies: int) -> list[Fp8Linear]:
    layers = []
    for _ in range(copies):
        layer = Fp8Linear(k, n, False).cuda()
        q, scale = quantize_rows(torch.randn(n, k, device="cuda") * 0.02)
        layer.weight.data.copy_(q)
        layer.weight_scale.data.copy_(scale)
        layers.append(layer)
    return layers


def _scaled_mm(xq, xs, layer):
    return torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale[None, :],
                            out_dtype=torch.bfloat16)


def call(name: str, config, x: torch.Tensor, layer: Fp8Linear, pre: tuple) -> torch.Tensor:
    """One call of candidate `name` on layer (pre: x quantized once, for "alone")."""
    if isinstance(config, StreamTiles):
        return fp8_stream(x, layer.weight, layer.weight_scale, None, config)
    if isinstance(config, Fp8Tiles):
        return fp8_gemv(x, layer.weight, layer.weight_scale, None, config)
    if isinstance(config, MmaTiles):
        return fp8_mma(x, layer.weight, layer.weight_scale, None, None, config)
    if isinstance(config, W8a8Tiles):
        return fp8_w8a8(*quantize_tokens(x), layer.weight, layer.weight_scale, None, config, x.dtype)
    if isinstance(config, SplitW8a8):
        xq, xs = quantize_tokens(x)
        return split_gemm(xq, layer.weight, None, config.tiles, scale=layer.weight_scale, out_dtype=x.dtype,
                          x_scale=xs)
    if isinstance(config, SplitTiles):
        return split_gemm(x, layer.weight, None, config, scale=layer.weight_scale)
    if name.startswith("split_w8a8") and "alone" in name:
        return split_gemm(pre[0], layer.weight, None, SplitW8a8().tiles, scale=layer.weight_scale,
                          out_dtype=x.dtype, x_scale=pre[1])
    if config == "scaled_mm":
        return _scaled_mm(*quantize_tokens(x), layer)
    if "torch-ops" in name:
        return _scaled_mm(*quantize_per_token(x), layer)
    return _scaled_mm(*pre, layer)


def _error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _line(label: str, us: float, nbytes: int, bf16_us: float, err: float | None = None) -> str:
    err_text = "" if err is None else f"  err {err:.1e}" + ("  OVER LIMIT" if err > ERROR_LIMIT else "")
    return f"    {label:42s} {us:8.2f} us  {nbytes / us / 1e3:7.0f} GB/s  x{bf16_us / us:5.2f} of bf16 cuBLAS{err_text}"


def measure(proj: str, n: int, k: int, batches: list[int], rows: list[dict], best: list[str],
            kernels: tuple[str, ...] = ()) -> None:
    copies = max(2, min(32, -(-256 * 2**20 // (n * k))))  # >= 256 MB of fp8 weights: reads come from HBM
    layers = fp8_layers(n, k, copies)
    dense = [layer.dequantize().to(torch.bfloat16) for layer in layers[:max(2, copies // 2)]]
    fp8_bytes, bf16_bytes = n * k + 4 * n, 2 * n * k
    for m in batches:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x.float(), layers[0].dequantize())
        pre = quantize_tokens(x)
        bf16_us = time_graph(lambda i: F.linear(x, dense[i % len(dense)]), copies)
        print(f"{proj} M={m} [{n}x{k}]  fp8 floor {fp8_bytes / HBM_READ_BYTES_PER_S * 1e6:.2f} us", flush=True)
        print(_line("bf16 cuBLAS", bf16_us, bf16_bytes, bf16_us))
        row = {"proj": proj, "M": m, "N": n, "K": k, "bf16_us": bf16_us, "configs": {}}
        gemv_tiles = choose_gemv_tiles(m, n, k, pdl=True)
        if gemv_tiles is not None:
            us = time_graph(lambda i: gemv_linear(x, dense[i % len(dense)], None, gemv_tiles), copies)
            print(_line("bf16 GEMV (the engine's at this M)", us, bf16_bytes, bf16_us))
            row["bf16_gemv_us"] = us
        winner = None
        for name, config in candidates(m, kernels):
            try:
                us = time_graph(lambda i: call(name, config, x, layers[i], pre), copies)
                err = _error(call(name, config, x, layers[0], pre), ref)
            except Exception as exc:  # a config the compiler or the GPU refuses: reported, never picked
                print(f"    {name:42s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}", flush=True)
                continue
            print(_line(name, us, fp8_bytes, bf16_us, err), flush=True)
            row["configs"][name] = {"us": us, "err": err}
            if config is not None and err <= ERROR_LIMIT and (winner is None or us < winner[0]):
                winner = (us, name, config)
        rule = choose_fp8_path(m, n, k, False, True)
        rule_us = time_graph(lambda i: layers[i].linear(x, pdl=False), copies)
        print(_line(f"rule: {rule}", rule_us, fp8_bytes, bf16_us, _error(layers[0].linear(x), ref)))
        row.update(rule=str(rule), rule_us=rule_us)
        rows.append(row)
        if winner is None:  # --kernels left no candidate at these rows
            continue
        row.update(best=winner[1], best_us=winner[0])
        best.append(f"    ({m}, {n}, {k}): {winner[2]!r},  # {proj}: {winner[0]:.2f} us, rule {rule_us:.2f} us, "
                    f"bf16 {bf16_us:.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default="llama-3.1-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--kernels", default="", help="comma-separated name prefixes of the candidates to run "
                    "(stream, gemv, w8a8, split, split_w8a8, mma, scaled_mm); default all")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[dict] = []
    best: list[str] = []
    for name in args.shapes.split(","):
        for proj, (n, k) in projections(SHAPES[name]).items():
            if proj != "lm_head":  # lm_head stays bf16 (model/fp8_weights.py)
                measure(f"{name} {proj}", n, k, batches, rows, best, tuple(filter(None, args.kernels.split(","))))
                torch.cuda.empty_cache()
    print("\ntable entries (kernels/fp8_linear.FP8_MEASURED; keep those that beat the rule):")
    print("\n".join(best))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
