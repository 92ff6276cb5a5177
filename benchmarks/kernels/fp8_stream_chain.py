"""A one-row step's FP8 projections as the decode graph launches them, against the read ceiling of the same grid.

Every layer's qkv, o, gate_up (the SwiGLU folded in) and down on the streaming GEMV (kernels/fp8_stream.py) at the
tiles choose_fp8_path gives one row, the RMSNorm before qkv and gate_up as its own kernel, all launched with PDL
into one CUDA graph over distinct weights for every layer (so nothing comes from L2), as in a decode step. Beside
it, the same chain with each norm computed by the last program of the projection before it (o and down:
fp8_stream_then_norm), the chain without the norm kernels (no step runs so: what the norms cost the chain, the
most that moving them into the projections could save), and the same grid and weight tiles with a kernel that
only reads them (the words summed as integers): the most this grid could draw from HBM. Then each projection's
chain alone, the GEMV and the read-only kernel, in us a layer.

Why: the per-call sweep (benchmarks/kernels/fp8_linear.py) times one kernel at a time without PDL and without the
kernels around it; this puts a step's GEMV time beside what reading those bytes in that grid takes, so what is left
shows projection by projection (instructions, loads of x, the norm's traffic) rather than as one step's total.

    PYTHONPATH=src python3 benchmarks/kernels/fp8_stream_chain.py [--shape llama-3.1-8b] [--layers 32]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from small_gemm import SHAPES, projections  # noqa: E402
from timing import HBM_READ_BYTES_PER_S, time_graph  # noqa: E402

from ostinato.kernels.fp8_linear import FP8_DTYPE, FP8_MAX, StreamTiles, choose_fp8_path, fp8_stream  # noqa: E402
from ostinato.kernels.fp8_stream import ResidualNorm, fp8_stream_then_norm  # noqa: E402
from ostinato.kernels.fused import fused_add_rms_norm  # noqa: E402
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait  # noqa: E402

NORMED = ("qkv", "gate_up")  # the projections a norm comes before
NORM_AFTER = ("o", "down")  # the projections a norm comes after


@triton.jit
def _read_only(w_ptr, out_ptr, N, K4, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr):
    """The streaming GEMV's grid, weight tiles and one-tile prefetch (the first before the PDL wait), the words
    summed as integers: its loads with almost no arithmetic."""
    pdl_begin(PDL)
    rows = tl.minimum(tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N - 1)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K4
    offs_j = tl.arange(0, BLOCK_J)
    w_next = tl.load(w_rows + offs_j[None, :], mask=(offs_j < K4)[None, :], other=0)
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_J], tl.int32)
    for j0 in range(0, K4, BLOCK_J):
        w = w_next
        js = j0 + BLOCK_J + offs_j
        w_next = tl.load(w_rows + js[None, :], mask=(js < K4)[None, :], other=0)
        acc += w
    tl.store(out_ptr + rows, tl.sum(acc, axis=1))


def read_only(weight: torch.Tensor, tiles: StreamTiles, pdl: bool = True) -> torch.Tensor:
    n, k = weight.shape
    out = torch.empty(n, device=weight.device, dtype=torch.int32)
    _read_only[(triton.cdiv(n, tiles.block_n),)](weight.view(torch.int32), out, n, k // 4, BLOCK_N=tiles.block_n,
                                                 BLOCK_J=tiles.block_k // 4, PDL=pdl, num_warps=tiles.num_warps,
                                                 num_stages=1, **launch_options(pdl))
    return out


def time_chain(fn) -> float:
    """Median us of one replay of a CUDA graph of fn() (benchmarks/kernels/timing.py)."""
    return time_graph(lambda _: fn(), 1, iters=20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    torch.manual_seed(0)
    hidden = SHAPES[args.shape][0]
    shapes = {name: nk for name, nk in projections(SHAPES[args.shape]).items() if name != "lm_head"}
    weights = {name: [(torch.randn(n, k, device="cuda") * 64).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
                      for _ in range(args.layers)] for name, (n, k) in shapes.items()}
    scales = {name: torch.rand(n, device="cuda") * 1e-3 + 1e-3 for name, (n, _) in shapes.items()}
    tiles = {name: choose_fp8_path(1, n, k, False, True, True) for name, (n, k) in shapes.items()}
    inputs = {name: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for name, (_, k) in shapes.items()}
    x, residual = inputs["qkv"], torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    norm_weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16)

    counter = torch.zeros(1, device="cuda", dtype=torch.int32)

    def step(only=None, reading=False, norms="apart"):
        def fn():
            normed = x
            for layer in range(args.layers):
                for name in shapes:
                    if only is not None and name != only:
                        continue
                    w = weights[name][layer]
                    if reading:
                        read_only(w, tiles[name])
                        continue
                    src = normed if name in NORMED and norms == "after" else inputs[name]
                    if name in NORMED and norms == "apart":
                        src, _ = fused_add_rms_norm(x, residual, norm_weight, 1e-5, pdl=True)
                    if name in NORM_AFTER and norms == "after":
                        after = ResidualNorm(residual, norm_weight, 1e-5, counter)
                        normed, _ = fp8_stream_then_norm(src, w, scales[name], None, tiles[name], after, pdl=True)
                    else:
                        fp8_stream(src, w, scales[name], None, tiles[name], pdl=True, glu=name == "gate_up")
        return fn

    total = sum(n * k for n, k in shapes.values()) * args.layers
    tile_text = ", ".join(f"{name} {t.block_n}x{t.block_k}" for name, t in tiles.items())
    print(f"{args.shape}, one row, {args.layers} layers: {total / 1e9:.2f} GB of FP8 weights; HBM read ceiling "
          f"{HBM_READ_BYTES_PER_S / 1e9:.0f} GB/s; tiles {tile_text}")
    chains = (("streaming GEMV, norm apart", step()), ("norm by o's / down's last program", step(norms="after")),
              ("the GEMVs without any norm", step(norms=None)), ("read-only, same grid", step(reading=True)))
    for label, fn in chains:
        us = time_chain(fn)
        share = total / us * 1e6 / HBM_READ_BYTES_PER_S
        print(f"  {label:34s} {us:8.1f} us  {total / us / 1e3:6.0f} GB/s  {share:.1%} of the ceiling")
    for name, (n, k) in shapes.items():
        nbytes = n * k * args.layers
        gemv, read = time_chain(step(name)), time_chain(step(name, reading=True))
        norm = ", with its norm" if name in NORMED else ""
        print(f"  {name:8s} {gemv / args.layers:6.2f} us a layer ({nbytes / gemv / 1e3:5.0f} GB/s){norm}, read-only "
              f"{read / args.layers:6.2f} ({nbytes / read / 1e3:5.0f} GB/s)")


if __name__ == "__main__":
    main()
