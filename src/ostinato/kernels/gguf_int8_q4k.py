"""Activations times Q4_K blocks as integer dot products (kernels/gguf_int8_dot.py says why, and quantizes x):
two kernels, one for a single row of x and one for 2-4 rows.

A Q4_K super-block is 256 weights in 144 bytes: a 16-byte header (d, dmin, twelve bytes of six-bit scales and
mins), then 128 bytes of codes, 32 words: word 8c + w holds bytes 4w..4w+3 of chunk c, whose low nibbles are
weights 64c + 4w.. of sub-block 2c and high nibbles weights 64c + 32 + 4w.. of sub-block 2c + 1. So the x words a
code word meets are xq[(word // 8) * 16 + word % 8] (low) and 8 words further (high), in x's own order. A program
takes BLOCK_N rows of W and walks K BLOCK_J code words at a time, the next tile requested while this one is
multiplied; the dp4a sums go per chunk before the header's scales apply, so the scale work is one eighth of the
code words'.

The tiles differ in what a thread holds:
- one row (_q4k_one_row_kernel): the code words as a 2-D [BLOCK_N, BLOCK_J] tile, 4 words a thread, laid out as
  kernels/fp8_stream.py lays its tile (that docstring says why): a warp's 16-byte loads cover contiguous bytes. A
  chunk spans two threads, so its sums meet the header and x's scales through shared memory.
- 2-4 rows (_q4k_rows_kernel): a chunk (8 words) a thread, as two [BLOCK_N, BLOCK_J / 8, 4] tiles of words 0-3
  and 4-7, so that a chunk's dp4a sums, its header (one 16-byte load) and x's scales stay in the thread that
  multiplies it: no barrier, and about a third fewer instructions a K step at 4 rows
  (`benchmarks/kernels/fp8_sass.py` counts them). At one row the first layout's steps were the faster ones, at
  four rows this one's (docs/PERFORMANCE.md, GGUF): one row is bound by its loads, more rows by their
  instructions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.gguf_int8_dot import (SUPER_BLOCK, QuantizedX, dp4a, group_sums, load_words, low_half,
                                            program_rows, quantize_x, row_groups, store_rows)
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)


@dataclass(frozen=True)
class Q4kTiles:
    """A program's share: block_n rows of W, K walked block_j code words (8 weights each) at a time. The default:
    the fastest summed over Llama-3.1-8B's four projections in `benchmarks/kernels/gguf_linear.py --sweep --types
    Q4_K --batches 1` (docs/PERFORMANCE.md, GGUF)."""

    block_n: int = 4
    block_j: int = 256
    num_warps: int = 4


@_jit
def _byte(word, shift):
    return ((word >> shift) & 255).to(tl.float32)


@_jit
def _chunk_scales(h1, h2, h3, c):
    """The six-bit scales and mins of chunk c (of its super-block) from header words 1-3, one a byte, four to a
    word, and the shift of the chunk's first sub-block's byte: sub-blocks 0-3 in words a, 4-7 in b (ggml's
    get_scale_min_k4, four bytes at a time); chunk c's sub-blocks 2c and 2c + 1 are bytes 2(c % 2) and
    2(c % 2) + 1 of word a (c < 2) or b."""
    sc = tl.where(c < 2, h1 & 0x3F3F3F3F, (h3 & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030))
    mn = tl.where(c < 2, h2 & 0x3F3F3F3F, ((h3 >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030))
    return sc, mn, 16 * (c % 2)


@_jit
def _scaled(sum_lo, sum_hi, dx_lo, dx_hi, sx_lo, sx_hi, cx_lo, cx_hi, sc, mn, shift, d, dmin):
    """A chunk's two sub-blocks' dp4a sums (float) scaled: d * sc * (dx * sum + cx) - dmin * mn * sx, summed."""
    part = _byte(sc, shift) * (dx_lo * sum_lo + cx_lo) + _byte(sc, shift + 8) * (dx_hi * sum_hi + cx_hi)
    offset = _byte(mn, shift) * sx_lo + _byte(mn, shift + 8) * sx_hi
    return d * part - dmin * offset


@_jit
def _code_words(w_rows, j0, offs_j, n_words, EVEN: tl.constexpr):
    """Code words j0 + offs_j of each row (8 weights a word; a super-block's 32 follow its 4 header words). j0 a
    multiple of BLOCK_J, itself of 32: the offset splits into a scalar and a constant tile, whose runs of 32
    contiguous words the compiler then reads 16 bytes at a time. EVEN (BLOCK_J divides n_words): no mask."""
    at = (j0 // 32) * 36 + 4 + (offs_j // 32) * 36 + offs_j % 32
    return load_words(w_rows + at[None, :], (j0 + offs_j < n_words)[None, :], EVEN)


@_jit
def _one_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, j0, x_at, j_mask, lo, hi, g, g_mask, sc, mn, shift, d, dmin,
                  BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """x's row times this K step's codes (lo, hi: the low and high nibbles of the code words), scaled per chunk:
    [BLOCK_N, CHUNKS]. xq's row is K / 4 = 2 n_words words, dx's, sx's and cx's K / 32 = n_words / 4."""
    xq = xq_ptr + (j0 // 8) * 16 + x_at
    x_lo = load_words(xq, j_mask, EVEN)
    x_hi = load_words(xq + 8, j_mask, EVEN)
    sum_lo = group_sums(dp4a(lo, x_lo, 0, ASM), BLOCK_N, CHUNKS, 8)
    sum_hi = group_sums(dp4a(hi, x_hi, 0, ASM), BLOCK_N, CHUNKS, 8)
    at = 2 * g
    dx_lo = tl.load(dx_ptr + at, mask=g_mask, other=0.0)
    dx_hi = tl.load(dx_ptr + at + 1, mask=g_mask, other=0.0)
    sx_lo = tl.load(sx_ptr + at, mask=g_mask, other=0.0)
    sx_hi = tl.load(sx_ptr + at + 1, mask=g_mask, other=0.0)
    cx_lo = tl.load(cx_ptr + at, mask=g_mask, other=0.0)
    cx_hi = tl.load(cx_ptr + at + 1, mask=g_mask, other=0.0)
    return _scaled(sum_lo, sum_hi, dx_lo, dx_hi, sx_lo, sx_hi, cx_lo, cx_hi, sc, mn, shift, d, dmin)


@_jit
def _q4k_one_row_kernel(xq_ptr, dx_ptr, sx_ptr, cx_ptr, w_ptr, b_ptr, out_ptr, N, n_words, row_words,
                        BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                        PDL: tl.constexpr, ASM: tl.constexpr):
    """out [1, N] = x W^T, x one row as quantize_x gives it."""
    q4k_one_row(tl.program_id(0), xq_ptr, dx_ptr, sx_ptr, cx_ptr, w_ptr, b_ptr, out_ptr, N, n_words, row_words,
                BLOCK_N, BLOCK_J, EVEN, HAS_BIAS, PDL, ASM)


@_jit
def q4k_one_row(program, xq_ptr, dx_ptr, sx_ptr, cx_ptr, w_ptr, b_ptr, out_ptr, N, n_words, row_words,
                BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr, HAS_BIAS: tl.constexpr,
                PDL: tl.constexpr, ASM: tl.constexpr):
    """_q4k_one_row_kernel's work for its program `program` (kernels/gguf_int8_mixed.py launches it beside
    another type's rows)."""
    pdl_begin(PDL)
    CHUNKS: tl.constexpr = BLOCK_J // 8
    offs_n, rows, w_rows = program_rows(w_ptr, row_words, N, BLOCK_N, program)
    offs_j = tl.arange(0, BLOCK_J)
    x_at = ((offs_j // 8) * 16 + offs_j % 8)[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)  # rows alike
    offs_c = tl.arange(0, CHUNKS)[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
    w_next = _code_words(w_rows, 0, offs_j, n_words, EVEN)  # weights only: requested before the wait
    pdl_wait(PDL)
    acc = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    for j0 in range(0, n_words, BLOCK_J):
        w = w_next
        # The next tile, or at the end this one again (in bounds, never used).
        w_next = _code_words(w_rows, tl.minimum(j0 + BLOCK_J, n_words - BLOCK_J) if EVEN else j0 + BLOCK_J,
                             offs_j, n_words, EVEN)
        j_mask = j0 + offs_j[None, :] < n_words
        lo = w & 0x0F0F0F0F
        hi = (w >> 4) & 0x0F0F0F0F
        g = j0 // 8 + offs_c  # chunk g: super-block g // 4, c = g % 4
        g_mask = g < n_words // 8
        head = w_rows + (g // 4) * 36
        h0 = tl.load(head, mask=g_mask, other=0)
        h1 = tl.load(head + 1, mask=g_mask, other=0)
        h2 = tl.load(head + 2, mask=g_mask, other=0)
        h3 = tl.load(head + 3, mask=g_mask, other=0)
        d = low_half(h0)
        dmin = low_half(h0 >> 16)
        sc, mn, shift = _chunk_scales(h1, h2, h3, g % 4)
        acc += _one_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, j0, x_at, j_mask, lo, hi, g, g_mask, sc, mn, shift, d,
                             dmin, BLOCK_N, CHUNKS, EVEN, ASM)
    store_rows(out_ptr, acc, acc, acc, acc, 0, b_ptr, rows, offs_n, N, 1, HAS_BIAS)  # one row: acc alone stored


@_jit
def _super_block_at(j0, c3):
    """The first word (its header) of the super-block that holds chunk c3 of the K step at code word j0: a scalar
    plus a constant tile."""
    return (j0 // 32) * 36 + (c3 // 4) * 36


@_jit
def _chunk_words(w3, j0, c3, k3, n_words, EVEN: tl.constexpr):
    """The code words of this K step's chunks (8 words each; c3 [BLOCK_N, CHUNKS, 1] the chunk within the step) of
    the rows w3 [BLOCK_N, 1, 1]: words 0-3 and 4-7 of each chunk as two [BLOCK_N, CHUNKS, 4] tiles laid out alike,
    so that one thread holds a whole chunk (its sums need no other thread's). j0, a multiple of BLOCK_J and so of a
    super-block's 32 code words, splits the offset into a scalar and a constant tile: chunk c of the step is chunk
    c % 4 of super-block j0 / 32 + c / 4, whose code words follow its 4 header words. EVEN: no mask."""
    at = _super_block_at(j0, c3) + 4 + (c3 % 4) * 8 + k3
    mask = j0 // 8 + c3 < n_words // 8
    return load_words(w3 + at, mask, EVEN), load_words(w3 + at + 4, mask, EVEN)


@_jit
def _pick(t, i: tl.constexpr, SIZE: tl.constexpr):
    """t[:, :, i] of the integer t [BLOCK_N, CHUNKS, SIZE], whose last dimension one thread holds (a select the
    compiler folds)."""
    return tl.sum(tl.where(tl.arange(0, SIZE)[None, None, :] == i, t, 0), axis=2)


@_jit
def _q4k_chunk_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, r, n_words, g3, k3, g_mask3, lo_a, lo_b, hi_a, hi_b, sc, mn,
                    shift, d, dmin, EVEN: tl.constexpr, ASM: tl.constexpr):
    """Row r of x times this K step's chunks (lo_*, hi_*: the low and high nibbles of their code words, words 0-3
    and 4-7), scaled: [BLOCK_N, CHUNKS]. Chunk g meets x words 16 g .. 16 g + 7 (low nibbles) and the 8 after
    (high); xq's rows are K / 4 = 2 n_words words, dx's, sx's and cx's K / 32 = n_words / 4."""
    xq = xq_ptr + r * (2 * n_words) + g3 * 16 + k3
    lo = dp4a(lo_b, load_words(xq + 4, g_mask3, EVEN), dp4a(lo_a, load_words(xq, g_mask3, EVEN), 0, ASM), ASM)
    hi = dp4a(hi_b, load_words(xq + 12, g_mask3, EVEN), dp4a(hi_a, load_words(xq + 8, g_mask3, EVEN), 0, ASM), ASM)
    at = r * (n_words // 4) + 2 * g3 + tl.arange(0, 2)[None, None, :]  # the chunk's two 32-blocks
    dx_lo, dx_hi = tl.split(tl.load(dx_ptr + at, mask=g_mask3, other=0.0))
    sx_lo, sx_hi = tl.split(tl.load(sx_ptr + at, mask=g_mask3, other=0.0))
    cx_lo, cx_hi = tl.split(tl.load(cx_ptr + at, mask=g_mask3, other=0.0))
    return _scaled(tl.sum(lo, axis=2).to(tl.float32), tl.sum(hi, axis=2).to(tl.float32), dx_lo, dx_hi, sx_lo, sx_hi,
                   cx_lo, cx_hi, sc, mn, shift, d, dmin)


@_jit
def _q4k_rows_kernel(xq_ptr, dx_ptr, sx_ptr, cx_ptr, w_ptr, b_ptr, out_ptr, N, n_words, row_words, stride_om,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr,
                     HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """out [ROWS, N] = x W^T, x as quantize_x gives it (2-4 rows; it also computes one, which the one-row kernel
    does faster): the codes and scales of a K step are decoded once for all rows, one accumulator a row."""
    pdl_begin(PDL)
    CHUNKS: tl.constexpr = BLOCK_J // 8
    offs_n, rows, w_rows = program_rows(w_ptr, row_words, N, BLOCK_N, tl.program_id(0))
    w3 = w_rows[:, :, None]
    c3 = tl.arange(0, CHUNKS)[None, :, None] + tl.zeros([BLOCK_N, 1, 1], tl.int32)  # x's pointers: rows alike
    k3 = tl.arange(0, 4)[None, None, :]
    next_a, next_b = _chunk_words(w3, 0, c3, k3, n_words, EVEN)  # weights only: requested before the wait
    pdl_wait(PDL)
    acc0 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for j0 in range(0, n_words, BLOCK_J):
        w_a, w_b = next_a, next_b
        # The next tile, or at the end this one again (in bounds, never used).
        next_a, next_b = _chunk_words(w3, tl.minimum(j0 + BLOCK_J, n_words - BLOCK_J) if EVEN else j0 + BLOCK_J,
                                      c3, k3, n_words, EVEN)
        lo_a, lo_b = w_a & 0x0F0F0F0F, w_b & 0x0F0F0F0F
        hi_a, hi_b = (w_a >> 4) & 0x0F0F0F0F, (w_b >> 4) & 0x0F0F0F0F
        g3 = j0 // 8 + c3  # the chunks' indices in the row
        g_mask3 = g3 < n_words // 8
        # Each chunk's super-block's 4 header words, one 16-byte load.
        head = load_words(w3 + (_super_block_at(j0, c3) + k3), g_mask3, EVEN)
        h0 = _pick(head, 0, 4)
        d, dmin = low_half(h0), low_half(h0 >> 16)
        # chunk c of its super-block: j0 starts one
        sc, mn, shift = _chunk_scales(_pick(head, 1, 4), _pick(head, 2, 4), _pick(head, 3, 4),
                                      tl.arange(0, CHUNKS)[None, :] % 4)
        acc0 += _q4k_chunk_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 0, n_words, g3, k3, g_mask3, lo_a, lo_b, hi_a, hi_b,
                                sc, mn, shift, d, dmin, EVEN, ASM)
        if ROWS > 1:
            acc1 += _q4k_chunk_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 1, n_words, g3, k3, g_mask3, lo_a, lo_b, hi_a,
                                    hi_b, sc, mn, shift, d, dmin, EVEN, ASM)
        if ROWS > 2:
            acc2 += _q4k_chunk_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 2, n_words, g3, k3, g_mask3, lo_a, lo_b, hi_a,
                                    hi_b, sc, mn, shift, d, dmin, EVEN, ASM)
        if ROWS > 3:
            acc3 += _q4k_chunk_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 3, n_words, g3, k3, g_mask3, lo_a, lo_b, hi_a,
                                    hi_b, sc, mn, shift, d, dmin, EVEN, ASM)
    store_rows(out_ptr, acc0, acc1, acc2, acc3, stride_om, b_ptr, rows, offs_n, N, ROWS, HAS_BIAS)


def q4k_rows_into(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  pdl: bool = False, tiles: Q4kTiles | None = None, qx: QuantizedX | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W the Q4_K blocks [N, 144 K / 256] uint8; out's and x's columns
    contiguous, their rows may be strided. qx: x already quantized (quantize_x), else it is here. Rows go in
    groups of up to MAX_ROWS; a group of one takes the one-row kernel."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    (m, k), n = x.shape, blocks.shape[0]
    assert k % SUPER_BLOCK == 0 and blocks.shape[1] == k // SUPER_BLOCK * 144 and out.shape == (m, n)
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.stride(-1) == 1
    tiles = tiles or Q4kTiles()
    words = blocks.view(torch.int32)
    qx = qx if qx is not None else quantize_x(x, pdl)
    grid = (triton.cdiv(n, tiles.block_n),)
    meta = dict(BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_j, EVEN=k // 8 % tiles.block_j == 0,
                HAS_BIAS=bias is not None, PDL=pdl, ASM=not KERNELS_INTERPRETED, num_warps=tiles.num_warps,
                **launch_options(pdl))
    for rows, q, outs in row_groups(qx, out):
        args = (q.xq, q.dx, q.sx, q.cx, words, bias if bias is not None else q.dx, outs, n, k // 8, words.shape[1])
        if rows == 1:
            _q4k_one_row_kernel[grid](*args, **meta)
        else:
            _q4k_rows_kernel[grid](*args, outs.stride(0), ROWS=rows, **meta)
