"""A bandwidth-bound Triton linear for decode batches of 2-16 rows, on the tensor cores: y = x @ W^T (+ b).

Why: between the GEMV's rows (kernels/gemv.py, M <= 4 at narrow N) and batches that fill a GEMM, cuBLAS reads a
decode projection's weight far below HBM bandwidth: whole decode steps with each projection ablated showed
Qwen3-0.6B's o_proj at batch 16 reading its weight at a small fraction of HBM bandwidth, where at batch 1 the GEMV
reads the same projections at about half of it or more.

Algorithm: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N output features for all M rows and walks K in
BLOCK_K steps: tl.dot of the [BLOCK_N, BLOCK_K] weight tile (K contiguous: 16-byte loads) with the
[BLOCK_K, M_PAD] activations (M padded to 16, the smallest tl.dot tile), an fp32 [BLOCK_N, M_PAD] accumulator,
software-pipelined over K (num_stages). The weight is the dot's left operand so that M, not N, is the padded
side: N / BLOCK_N programs, and the x tile is re-read from L2 by each. The first weight tile is requested
before the PDL wait (kernels/pdl.py: the step never writes weights), so with PDL the weight read starts during the
kernel before. One kernel per call, grid from shapes only: CUDA-graph safe. No split over K: split with an
in-launch merge of the partials, it won alone on some long-K shapes but lost in every whole decode step measured
(Llama-3.2-1B qkv and down, Llama-3.1-8B o and down, splits of 2, 4, 8).
With glu, the SwiGLU activation of a (gate | up) projection comes out of the epilogue (kernels/linear_epilogue.py).
The RMSNorm before the projection stays its own kernel: folded into this kernel's prologue (every program first
passes over its rows for their 1/rms, after the PDL wait) it cost whole steps far more than the norms' own time
(docs/PERFORMANCE.md, "Why these defaults").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels import deferred_launch
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)

if triton is not None:  # the torch path needs none of these
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED, dot, dot_settings
    from ostinato.kernels.linear_epilogue import glu_rows, store_glu

MAX_ROWS = 16  # one tl.dot tile of rows; above it the rows are a GEMM's, and cuBLAS is the tool


@_jit
def _skinny_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    GLU: tl.constexpr, EMULATE_BF16: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs_n, w_index = glu_rows(pid, N, BLOCK_N, GLU)  # each row's output; its row of W
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    x_cols = x_ptr + offs_m[None, :] * stride_xm  # [1, M_PAD]: x read transposed, [BLOCK_K, M_PAD]
    ks = offs_k
    k_mask = ks < K
    w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # before the wait
    pdl_wait(PDL)
    x_t = tl.load(x_cols + ks[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)
    acc = dot(w, x_t, DOT_PRECISION, UPCAST_DOT)  # [BLOCK_N, M_PAD] fp32
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x_t = tl.load(x_cols + ks[:, None], mask=k_mask[:, None] & m_mask[None, :], other=0.0)
        acc += dot(w, x_t, DOT_PRECISION, UPCAST_DOT)
    _finish(out_ptr, b_ptr, acc, pid, offs_n, w_index, n_mask, offs_m, m_mask, N, stride_om, M_PAD, BLOCK_N,
            HAS_BIAS, GLU, EMULATE_BF16)


@_jit
def _finish(out_ptr, b_ptr, acc, pid, offs_n, w_index, n_mask, offs_m, m_mask, N, stride_om, M_PAD: tl.constexpr,
            BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, GLU: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """acc [BLOCK_N, M_PAD] fp32 (+ bias) stored as out[offs_m, offs_n], or its (gate, up) row pairs as
    silu(gate) * up (GLU)."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + w_index, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    if GLU:
        cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        store_glu(out_ptr, tl.trans(acc), offs_m, cols, m_mask[:, None] & (cols < N)[None, :], stride_om, M_PAD,
                  BLOCK_N, EMULATE_BF16)
    else:
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & m_mask[None, :])


@dataclass(frozen=True)
class SkinnyTiles:
    """block_n outputs (>= 16) by block_k inputs (>= 16) per step, both powers of two; num_stages: the K loop's
    software-pipelining depth (weight and x tiles in flight)."""

    block_n: int = 16
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: SkinnyTiles,
                  out_dtype: torch.dtype | None = None, pdl: bool = False, glu: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous, M <= MAX_ROWS), weight [N, K] contiguous, bias [N] or None -> [M, N] in out_dtype
    (default x's dtype), accumulated in fp32. pdl: launch with programmatic dependent launch (kernels/pdl.py; the
    caller checked the device supports it). glu: W is a
    (gate | up) projection [2I, K] and the output silu(gate) * up [M, I] (kernels/gemv.py's gemv_linear)."""
    m, k = x.shape
    n = weight.shape[0]
    assert m <= MAX_ROWS and x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous()
    rows_per_output = 1
    if glu:
        assert n % 2 == 0, "a (gate | up) projection has an even number of rows"
        n, rows_per_output = n // 2, 2
    out = torch.empty(m, n, device=x.device, dtype=out_dtype or x.dtype)
    if m == 0:
        return out
    m_pad = max(16, triton.next_power_of_2(m))
    blocks = triton.cdiv(n * rows_per_output, tiles.block_n)
    deferred_launch.launch(_skinny_kernel, (blocks,), (
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
    ), dict(
        M_PAD=m_pad, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        HAS_BIAS=bias is not None, PDL=pdl, **dot_settings(x.dtype),  # fp32 exact; bf16 upcast when interpreted
        GLU=glu, EMULATE_BF16=KERNELS_INTERPRETED and x.dtype == torch.bfloat16,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(pdl),
    ), (out,))
    return out


# Where it was measured to beat cuBLAS: projections with one side <= 1024 and the other <= 6144, and wider-than-long
# ones of K <= 2048 up to 4096 outputs (Llama-3.2-1B's qkv_proj, 3072 x 2048; its square o_proj lost).
_MAX_NARROW_SIDE, _MAX_WIDE_SIDE = 1024, 6144
_MAX_WIDENING_K, _MAX_WIDENING_N = 2048, 4096


def _measured_to_win(n: int, k: int) -> bool:
    """Whether W [n, k] is of a kind the few-rows kernel beat cuBLAS on in whole steps (choose_skinny_tiles)."""
    narrow = min(n, k) <= _MAX_NARROW_SIDE and max(n, k) <= _MAX_WIDE_SIDE
    widening = k < n <= _MAX_WIDENING_N and k <= _MAX_WIDENING_K
    return narrow or widening


def choose_skinny_tiles(m: int, n: int, k: int, pdl: bool = False) -> SkinnyTiles | None:
    """Tiles for y[m, n] = x[m, k] @ W^T at 2-16 rows the GEMV does not take, or None where cuBLAS stays. From
    shapes only, so it is fixed before capture. Read off whole decode steps, each projection on this kernel
    against cuBLAS (figures: docs/PERFORMANCE.md, "Why these defaults"):
    - Qwen3-0.6B (every projection has one side of 1024 and the other at most 6144): faster at 4, 8 and 16 rows.
    - Llama-3.2-1B (qkv 3072 x 2048, o 2048 x 2048, gate_up 16384 x 2048, down 2048 x 8192): only qkv won;
      o and gate_up lost, down tied (left to cuBLAS).
    - Llama-3.1-8B: o and down lost by hundreds of microseconds a step. cuBLAS.
    Split over K won alone on some long-K shapes but lost in every whole step measured (1B qkv and down, 8B o and
    down, splits of 2, 4, 8), so the kernel no longer splits (module docstring).
    """
    if not 2 <= m <= MAX_ROWS or not _measured_to_win(n, k):
        return None
    return tiles_for_rows(m)


def tiles_for_rows(m: int) -> SkinnyTiles:
    """The measured tiles at m rows (choose_skinny_tiles): longer K steps at up to 4 rows, more outputs a
    program at 5-8, deeper pipelining above. Decode graphs run at captured sizes (1, 2, 4, 8, 16 by default),
    so 8 and 16 stand for the rows between."""
    if m <= 4:
        return SkinnyTiles(16, 512, num_stages=3)
    if m <= 8:
        return SkinnyTiles(32, 256, num_stages=3)
    return SkinnyTiles(16, 256, num_stages=4)


GLU_NO_PDL_ABOVE_ROWS = 8


def keeps_pdl(m: int, glu: bool) -> bool:
    """Whether a few-rows launch of m rows keeps PDL in a step that uses it: every launch but the (gate | up)
    projection with its SwiGLU folded in (glu) above 8 rows, which waits for the kernel before to finish.
    Why: with PDL the wide launch's programs (384 for Qwen3's gate_up) sit resident and waiting while the
    kernel before still runs, and at 16 rows that cost more than the early start saved; every other launch
    measured faster with PDL (docs/PERFORMANCE.md, "Why these defaults"). Not re-measured since the decode
    attention's PDL trigger moved after its K/V loop."""
    return not (glu and m > GLU_NO_PDL_ABOVE_ROWS)
