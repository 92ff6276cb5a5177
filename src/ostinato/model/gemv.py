"""A bandwidth-bound Triton linear for decode batches of a few rows: y = x @ W^T (+ b), W [N, K] row-major.

Why: at M <= 4 a decode projection reads its whole weight to make a few outputs, so its time should be
the weight bytes over HBM bandwidth. cuBLAS at the small projections of the small models is far from
that (H200, in a graph: the Qwen3-0.6B o_proj, 4 MB, takes 12.7 us at M = 1 and 5.9 us at M = 8; the
floor is 1 us), and every projection pays ~5 us however small (docs/PERFORMANCE.md, issue 11).

Algorithm: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N output features for all M rows and walks K in
BLOCK_K chunks: a [BLOCK_N, BLOCK_K] weight tile (K contiguous: coalesced 16-byte loads) times the
[M_PAD, BLOCK_K] activations, multiplied elementwise into an fp32 [M_PAD, BLOCK_N, BLOCK_K] accumulator
that is summed over K once, at the end (no cross-thread reduction inside the loop). No split over K, so
no reduce kernel and no atomics: small BLOCK_N gives enough programs instead (N / BLOCK_N >= a few per SM).
Exactly one kernel per call, grid from shapes only: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..pdl import launch_options, pdl_begin, pdl_wait
from ..triton_optional import jit as _jit
from ..triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)


@_jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PEEL_FIRST: tl.constexpr, PDL: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_rows = x_ptr + offs_m[:, None] * stride_xm  # [M_PAD, 1]
    if PEEL_FIRST:
        # The first K step out of the loop, its weight tile requested before the wait for the previous kernel
        # (pdl.py): weights are never written by the step, so with PDL their read overlaps that kernel.
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        pdl_wait(PDL)
        x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]  # [M_PAD, BLOCK_N, BLOCK_K]
        k_start = BLOCK_K
    else:
        pdl_wait(PDL)
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
        k_start = 0
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        x = tl.load(x_rows + ks[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [M_PAD, BLOCK_K]
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemvTiles:
    """block_n outputs by block_k inputs per step. peel_first: the first K step runs before the loop, its
    weight tile loaded before the PDL wait (H200, M = 1, isolated: faster at K <= 3072, 0.1-0.4 us; slower at
    the 8B's o_proj and down_proj, K >= 4096 with block_n 4, by 1.3 and 6.6 us; docs/PERFORMANCE.md)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    peel_first: bool = False


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: GemvTiles,
                out_dtype: torch.dtype | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous), weight [N, K] contiguous, bias [N] or None -> [M, N] in out_dtype (default
    x's dtype), accumulated in fp32. Meant for M <= 8; the accumulator is M_PAD * block_n * block_k fp32.
    pdl: launch with programmatic dependent launch (pdl.py; the caller checked the device supports it)."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.is_contiguous() and x.stride(-1) == 1
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0:
        return out
    _gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, bias if bias is not None else weight, out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
        PEEL_FIRST=tiles.peel_first, PDL=pdl, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(pdl),
    )
    return out


_PEEL_MAX_K = 3072  # GemvTiles.peel_first up to this K (Qwen3-0.6B's projections, Llama-3.2-1B's qkv and o)


def choose_gemv_tiles(m: int, n: int, k: int, pdl: bool = False) -> GemvTiles | None:
    """Tiles for y[m, n] = x[m, k] @ W^T, or None where cuBLAS is as fast. A rule read off the H200 sweep
    (scripts/gpu_gemv.py, docs/PERFORMANCE.md issue 11), from shapes only, so it is fixed before capture:
    - m == 1, n <= 8192: faster than cuBLAS on every such projection of Qwen3-0.6B, Llama-3.2-1B and
      Llama-3.1-8B (1.05-3.5x; the Qwen3 gate_up ties). block_n gives ~768-1024 programs.
    - m == 1, wider (gate_up of the 1B and 8B): alone, cuBLAS reads them at 85-97% of HBM bandwidth and is
      1-1.4 us faster; with PDL (pdl.py) the GEMV's weight read starts during the norm before it and the layer
      stays one chain of PDL launches: whole step 1.0526 -> 1.0431 ms (1B) and 4.4175 -> 4.3417 ms (8B),
      scripts/gpu_pdl.py (now --cublas-wide). So the GEMV there only with PDL.
    - 2 <= m <= 4, n <= 1024: only there did it beat cuBLAS (Qwen3-0.6B o_proj and down_proj, 1.4-1.9x);
      at wider n the [m, block_n, block_k] accumulator leaves too few programs or too many registers.
    """
    if m == 1 and (n <= 8192 or pdl):
        block_n = 1
        while block_n < 8 and block_n * 2 <= n // 768:
            block_n *= 2
        return GemvTiles(block_n, 1024, peel_first=k <= _PEEL_MAX_K)
    if 2 <= m <= 4 and n <= 1024:
        return GemvTiles(2, 1024, peel_first=k <= _PEEL_MAX_K)
    return None


def small_batch_linear(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False) -> torch.Tensor:
    """layer(x) for x [M, K]: the Triton kernel where choose_gemv_tiles picks it, cuBLAS (F.linear) otherwise.
    For 16-bit CUDA tensors (the decoder's Triton kernel set calls it). `layer` is an nn.Linear, or a
    tensor-parallel one (model/parallel.py), which on one rank is an nn.Linear too."""
    tp = getattr(layer, "tp", None)
    if tp is not None and tp.world_size > 1:
        return layer(x)  # a row-parallel projection: its forward adds the all-reduce (model/parallel.py)
    weight = layer.weight
    tiles = None
    if x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype \
            and weight.is_contiguous() and x.stride(-1) == 1:
        tiles = choose_gemv_tiles(x.shape[0], weight.shape[0], weight.shape[1], pdl)
    if tiles is None:
        return torch.nn.functional.linear(x, weight, layer.bias)
    return gemv_linear(x, weight, layer.bias, tiles, pdl=pdl)
