"""Activations times Q4_K blocks as integer dot products: the batch-1 decode's GGUF projections, and, given tiles,
a few rows. Also what the Q6_K and Q8_0 kernels (kernels/gguf_int8_q6k_q80.py) share: the quantized activations,
the dp4a, the row handling. Q4_K_M files are Q4_K and Q6_K.

Why: a 4-bit weight is a quarter of a bf16 one, so at the bandwidth floor a GEMV must finish each weight in about
five thread instructions (H100: ~3 TB/s of HBM, 2 Q4_K weights a byte, 128 instructions a clock per SM). Decoding
each weight to fp32 (kernels/gguf_gemv.py) costs an int-to-float conversion per weight, a quarter-rate
instruction, plus its scale and offset: the conversions alone cap that kernel below the floor. Here the row of x
is quantized to int8 in blocks of 32 (one scale each), as llama.cpp's mat-vec kernels do, and four weights meet
four activations in one `dp4a` (a 4-way int8 dot product accumulated in int32): a 32-bit word of Q4_K codes holds
eight weights, its low nibbles one sub-block's and its high nibbles the next's, and each half costs a mask (and a
shift) and one dp4a. The scales apply once per sub-block of 32 weights:

    sum_i (d * sc * q_i - dmin * mn) * x_i  ~  d * sc * (dx * sum_i (q_i - 8) * xq_i + 8 * sum_i x_i)
                                                - dmin * mn * sum_i x_i

where xq_i = round(x_i / dx) in [-127, 127] and dx = max|x| / 127 over the 32 activations. The sums of x are
taken from x itself, so the rounding of the activations only meets the codes centred on 8 (on random Q4_K rows
about 0.6 of the error of sum_i q_i * xq_i: codes 0..15 spread less about 8 than about 0).
The dp4a multiplies the raw codes; dx * sum_i (q_i - 8) xq_i + 8 sum_i x_i = dx * dp4a + cx, with
cx = 8 (sum_i x_i - dx sum_i xq_i) made once per 32-block by the quantizing kernel.

Two kernels: the first quantizes x (int8 codes packed four to a word in x's column order, and each 32-block's
dx, sum of x and cx); the second takes BLOCK_N rows of W a program and walks K BLOCK_J code words at a time. A Q4_K
super-block is 256 weights in 144 bytes: a 16-byte header (d, dmin, twelve bytes of six-bit scales and mins),
then 128 bytes of codes, 32 words: word 8c + w holds bytes 4w..4w+3 of chunk c, whose low nibbles are weights
64c + 4w.. of sub-block 2c and high nibbles weights 64c + 32 + 4w.. of sub-block 2c + 1. So the x words a code
word meets are xq[(word // 8) * 16 + word % 8] (low) and 8 words further (high), in x's own order.

Laid out as kernels/fp8_stream.py lays its tile (that docstring says why): the code words as a 2-D [BLOCK_N,
BLOCK_J] tile, 4 words a thread (one 16-byte load), x's words through pointers of the same shape (rows alike),
the next tile requested while this one is multiplied. The dp4a sums go per chunk ([BLOCK_N, BLOCK_J / 8]) before
the header's scales apply, so the scale work is one eighth of the code words'.

Rows: a kernel keeps one accumulator for each of up to MAX_ROWS rows of x and decodes each K step's codes and
scales once for all of them; more rows go in groups, each a pass over W (x quantized once for all groups).
gguf_gemv sends x here by default at the row counts INT8_DOT_ROWS gives each type, up to 8: above them the
projections are a GEMM's, dense slices and cuBLAS.

For bf16/fp16 activations only: float32 runs (the reference runs) keep the kernel that decodes to fp32. Against
the gguf library's dequantize-then-matmul the outputs are off by about 0.6% of their norm (the fp32 decoding's
bf16 output: 0.26%; docs/PERFORMANCE.md, GGUF): the approximation llama.cpp's mat-vec kernels make.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ostinato.kernels.gguf_linear import Q4_K, Q6_K, Q8_0
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

# The ggml types whose projections take integer dot products by default, and at how many rows of x (first, last):
# where they beat the kernel that decodes to fp32 (kernels/gguf_gemv.py) in whole decode steps of the 8B shape
# (docs/PERFORMANCE.md, GGUF). gguf_gemv.gguf_linear_into dispatches; the Q6_K and Q8_0 kernels are in
# kernels/gguf_int8_q6k_q80.py.
INT8_DOT_ROWS = {Q4_K: (1, 8), Q6_K: (1, 8), Q8_0: (1, 8)}
# The multiple of K each type's kernel needs: a super-block for the k-quants; Q8_0's planar rows
# (kernels/gguf_linear.py) are read as 32-bit words, which they are only for an even number of blocks. Other K
# keep the fp32 decoding.
INT8_DOT_K = {Q4_K: 256, Q6_K: 256, Q8_0: 64}
SUPER_BLOCK = 256  # weights of a K-quant super-block (Q4_K: 144 bytes, 36 words of which 4 header; Q6_K: 210)


# Rows of x one kernel takes (one accumulator each); more go in groups of this many, each a pass over W.
MAX_ROWS = 4


@dataclass(frozen=True)
class Q4kTiles:
    """A program's share: block_n rows of W, K walked block_j code words (8 weights each) at a time. The default:
    the fastest summed over Llama-3.1-8B's four projections in `benchmarks/kernels/gguf_linear.py --sweep --types
    Q4_K --batches 1` (docs/PERFORMANCE.md, GGUF)."""

    block_n: int = 4
    block_j: int = 256
    num_warps: int = 4


@_jit
def dp4a(a, b, c, ASM: tl.constexpr):
    """c + the dot product of a's four unsigned bytes with b's four signed ones (int32 words)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:  # the Triton interpreter runs no PTX
        acc = c
        for j in tl.static_range(4):
            acc += ((a >> (8 * j)) & 255) * ((b << (24 - 8 * j)) >> 24)
        return acc


@_jit
def dp4a_signed(a, b, c, ASM: tl.constexpr):
    """c + the dot product of a's four signed bytes with b's four signed ones (int32 words)."""
    if ASM:
        return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        acc = c
        for j in tl.static_range(4):
            acc += ((a << (24 - 8 * j)) >> 24) * ((b << (24 - 8 * j)) >> 24)
        return acc


@_jit
def _quantize_x_kernel(x_ptr, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, K, stride_xm, BLOCKS: tl.constexpr,
                       PDL: tl.constexpr):
    """Row program_id(1) of x [M, K] -> its row of xq [M, K / 4] (int8 codes, four a word, x's order); per 32-block
    [M, K / 32]: dx (the scale, max|x| / 127), sx (the sum of x) and cx = 8 (sx - dx * the sum of the codes); per
    16-block [M, K / 16]: s16, the sum of the codes (float). BLOCKS 32-blocks a program."""
    pdl_begin(PDL)
    r = tl.program_id(1)
    b = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    b_mask = b < K // 32
    word = b[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BLOCKS, 8]
    pdl_wait(PDL)
    x = tl.load(x_ptr + r * stride_xm + word[:, :, None] * 4 + tl.arange(0, 4)[None, None, :],
                mask=b_mask[:, None, None], other=0.0).to(tl.float32)
    store_quantized(x, r, b, b_mask, word, K, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, BLOCKS)


@_jit
def store_quantized(x, r, b, b_mask, word, K, xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, BLOCKS: tl.constexpr):
    """x [BLOCKS, 8, 4] float32, the 32-blocks b of row r (words `word` [BLOCKS, 8] of it) -> their codes, dx, sx,
    cx and s16 stored, as _quantize_x_kernel's docstring says."""
    amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.maximum(amax, 1e-30), 0.0)
    v = x * inv[:, None, None]
    q = tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32)  # round half away from zero, as llama.cpp's roundf
    shifts = 8 * tl.arange(0, 4)
    packed = tl.sum((q & 255) << shifts[None, None, :], axis=2)  # disjoint bytes: the sum is their OR
    tl.store(xq_ptr + r * (K // 4) + word, packed, mask=b_mask[:, None])
    at = r * (K // 32) + b
    tl.store(dx_ptr + at, amax / 127.0, mask=b_mask)
    sx = tl.sum(tl.sum(x, axis=2), axis=1)
    tl.store(sx_ptr + at, sx, mask=b_mask)
    tl.store(cx_ptr + at, 8.0 * (sx - amax / 127.0 * tl.sum(tl.sum(q, axis=2), axis=1).to(tl.float32)), mask=b_mask)
    halves = tl.sum(tl.reshape(tl.sum(q, axis=2), [BLOCKS, 2, 4]), axis=2).to(tl.float32)  # [BLOCKS, 2]
    tl.store(s16_ptr + r * (K // 16) + b[:, None] * 2 + tl.arange(0, 2)[None, :], halves, mask=b_mask[:, None])


@_jit
def load_words(ptrs, mask, EVEN: tl.constexpr):
    """The words at ptrs; masked (0 outside mask) unless EVEN, where no mask stands in the way of wide loads."""
    if EVEN:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=mask, other=0)


@_jit
def group_sums(dots, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SIZE: tl.constexpr):
    """dots [BLOCK_N, GROUPS * SIZE] int32 summed over each SIZE consecutive columns: [BLOCK_N, GROUPS] float."""
    return tl.sum(tl.reshape(dots, [BLOCK_N, GROUPS, SIZE]), axis=2).to(tl.float32)


@_jit
def _code_words(w_rows, j0, offs_j, n_words, EVEN: tl.constexpr):
    """Code words j0 + offs_j of each row (8 weights a word; a super-block's 32 follow its 4 header words). j0 a
    multiple of BLOCK_J, itself of 32: the offset splits into a scalar and a constant tile, whose runs of 32
    contiguous words the compiler then reads 16 bytes at a time. EVEN (BLOCK_J divides n_words): no mask."""
    at = (j0 // 32) * 36 + 4 + (offs_j // 32) * 36 + offs_j % 32
    return load_words(w_rows + at[None, :], (j0 + offs_j < n_words)[None, :], EVEN)


@_jit
def low_half(h):
    """The fp16 in the low 16 bits of int32 h, as float."""
    return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _byte(word, shift):
    return ((word >> shift) & 255).to(tl.float32)


@_jit
def _q4k_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, r, n_words, j0, x_at, j_mask, lo, hi, g, g_mask, sc, mn, shift,
                  d, dmin, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """Row r of x times this K step's codes (lo, hi: the low and high nibbles of the code words), scaled per chunk:
    [BLOCK_N, CHUNKS]. xq's rows are K / 4 = 2 n_words words, dx's, sx's and cx's K / 32 = n_words / 4."""
    xq = xq_ptr + r * (2 * n_words) + (j0 // 8) * 16 + x_at
    x_lo = load_words(xq, j_mask, EVEN)
    x_hi = load_words(xq + 8, j_mask, EVEN)
    sum_lo = group_sums(dp4a(lo, x_lo, 0, ASM), BLOCK_N, CHUNKS, 8)
    sum_hi = group_sums(dp4a(hi, x_hi, 0, ASM), BLOCK_N, CHUNKS, 8)
    at = r * (n_words // 4) + 2 * g
    dx_lo = tl.load(dx_ptr + at, mask=g_mask, other=0.0)
    dx_hi = tl.load(dx_ptr + at + 1, mask=g_mask, other=0.0)
    sx_lo = tl.load(sx_ptr + at, mask=g_mask, other=0.0)
    sx_hi = tl.load(sx_ptr + at + 1, mask=g_mask, other=0.0)
    cx_lo = tl.load(cx_ptr + at, mask=g_mask, other=0.0)
    cx_hi = tl.load(cx_ptr + at + 1, mask=g_mask, other=0.0)
    part = _byte(sc, shift) * (dx_lo * sum_lo + cx_lo) + _byte(sc, shift + 8) * (dx_hi * sum_hi + cx_hi)
    offset = _byte(mn, shift) * sx_lo + _byte(mn, shift + 8) * sx_hi
    return d * part - dmin * offset


@_jit
def program_rows(w_ptr, row_len, N, BLOCK_N: tl.constexpr):
    """This program's rows of W: their output columns, the rows read (past N the last one, read and never
    stored) and pointers to them, [BLOCK_N, 1] (row_len: a row's length in w_ptr's elements)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1)
    return offs_n, rows, w_ptr + rows.to(tl.int64)[:, None] * row_len


@_jit
def _store_row(out_ptr, acc, r, stride_om, b_ptr, rows, offs_n, N, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows).to(tl.float32)
    tl.store(out_ptr + r * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


@_jit
def store_rows(out_ptr, acc0, acc1, acc2, acc3, stride_om, b_ptr, rows, offs_n, N, ROWS: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Rows 0..ROWS-1 of out from their accumulators ([BLOCK_N, steps' columns], summed across)."""
    _store_row(out_ptr, acc0, 0, stride_om, b_ptr, rows, offs_n, N, HAS_BIAS)
    if ROWS > 1:
        _store_row(out_ptr, acc1, 1, stride_om, b_ptr, rows, offs_n, N, HAS_BIAS)
    if ROWS > 2:
        _store_row(out_ptr, acc2, 2, stride_om, b_ptr, rows, offs_n, N, HAS_BIAS)
    if ROWS > 3:
        _store_row(out_ptr, acc3, 3, stride_om, b_ptr, rows, offs_n, N, HAS_BIAS)


@_jit
def _q4k_row_kernel(xq_ptr, dx_ptr, sx_ptr, cx_ptr, w_ptr, b_ptr, out_ptr, N, n_words, row_words, stride_om,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """out [ROWS, N] = x W^T, x as quantize_x gives it (ROWS <= MAX_ROWS rows, one accumulator each): the codes
    and scales of a K step are decoded once for all rows."""
    pdl_begin(PDL)
    CHUNKS: tl.constexpr = BLOCK_J // 8
    offs_n, rows, w_rows = program_rows(w_ptr, row_words, N, BLOCK_N)
    offs_j = tl.arange(0, BLOCK_J)
    x_at = ((offs_j // 8) * 16 + offs_j % 8)[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)  # rows alike
    offs_c = tl.arange(0, CHUNKS)[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
    w_next = _code_words(w_rows, 0, offs_j, n_words, EVEN)  # weights only: requested before the wait
    pdl_wait(PDL)
    acc0 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
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
        # The eight six-bit scales and mins, one a byte, four to a word: sub-blocks 0-3 in words a, 4-7 in b
        # (ggml's get_scale_min_k4, four bytes at a time). Chunk c's sub-blocks 2c and 2c + 1 are bytes
        # 2(c % 2) and 2(c % 2) + 1 of word a (c < 2) or b.
        c = g % 4
        sc = tl.where(c < 2, h1 & 0x3F3F3F3F, (h3 & 0x0F0F0F0F) | ((h1 >> 2) & 0x30303030))
        mn = tl.where(c < 2, h2 & 0x3F3F3F3F, ((h3 >> 4) & 0x0F0F0F0F) | ((h2 >> 2) & 0x30303030))
        shift = 16 * (c % 2)
        acc0 += _q4k_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 0, n_words, j0, x_at, j_mask, lo, hi, g, g_mask, sc,
                              mn, shift, d, dmin, BLOCK_N, CHUNKS, EVEN, ASM)
        if ROWS > 1:
            acc1 += _q4k_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 1, n_words, j0, x_at, j_mask, lo, hi, g, g_mask,
                                  sc, mn, shift, d, dmin, BLOCK_N, CHUNKS, EVEN, ASM)
        if ROWS > 2:
            acc2 += _q4k_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 2, n_words, j0, x_at, j_mask, lo, hi, g, g_mask,
                                  sc, mn, shift, d, dmin, BLOCK_N, CHUNKS, EVEN, ASM)
        if ROWS > 3:
            acc3 += _q4k_row_part(xq_ptr, dx_ptr, sx_ptr, cx_ptr, 3, n_words, j0, x_at, j_mask, lo, hi, g, g_mask,
                                  sc, mn, shift, d, dmin, BLOCK_N, CHUNKS, EVEN, ASM)
    store_rows(out_ptr, acc0, acc1, acc2, acc3, stride_om, b_ptr, rows, offs_n, N, ROWS, HAS_BIAS)


# 32-blocks of x a program of the quantizing kernel: few, so that even K = 4096 spreads over 32 programs (the
# kernel is a few microseconds of latency in every projection of a one-row step, not bandwidth).
QUANTIZE_BLOCKS = 4


def int8_dot_applies(x: torch.Tensor, qtype: int) -> bool:
    """Whether gguf_linear_into sends x times qtype's blocks to these kernels by default: half-precision rows, as
    many as INT8_DOT_ROWS gives the type, K as INT8_DOT_K (float32 runs, the reference runs, keep the fp32
    decoding)."""
    return half_rows_within(x, INT8_DOT_ROWS.get(qtype), INT8_DOT_K.get(qtype, 1))


def half_rows_within(x: torch.Tensor, rows: tuple[int, int] | None, k_multiple: int) -> bool:
    """x [M, K] is half precision, M within rows (first, last; None: none) and K a multiple of k_multiple: where
    an int8 kernel takes x by default."""
    return rows is not None and rows[0] <= x.shape[0] <= rows[1] and x.dtype in (torch.bfloat16, torch.float16) \
        and x.shape[1] % k_multiple == 0


class QuantizedX(NamedTuple):
    """x [M, K] as the integer-dot kernels read it (quantize_x): xq [M, K / 4] int32 (int8 codes, four a word, in
    x's order); per 32-block [M, K / 32] float32, dx (the scale), sx (the sum of x) and cx (see the kernel); per
    16-block [M, K / 16], s16 (the sum of the codes, float). Made once, it serves every projection of that x
    (GGUFConcat's shards)."""

    xq: torch.Tensor
    dx: torch.Tensor
    sx: torch.Tensor
    cx: torch.Tensor
    s16: torch.Tensor

    def rows(self, r0: int, r1: int) -> QuantizedX:
        return QuantizedX(*(t[r0:r1] for t in self))


def empty_quantized(m: int, k: int, device: torch.device) -> QuantizedX:
    """Room for m rows of K activations quantized: one allocation."""
    buf = torch.empty(m * (k // 4 + 3 * (k // 32) + k // 16), device=device, dtype=torch.int32)
    xq = buf[:m * (k // 4)].view(m, k // 4)
    floats = buf[m * (k // 4):].view(torch.float32)
    dx, sx, cx = floats[:3 * m * (k // 32)].view(3, m, k // 32)
    return QuantizedX(xq, dx, sx, cx, floats[3 * m * (k // 32):].view(m, k // 16))


def quantize_x(x: torch.Tensor, pdl: bool = False) -> QuantizedX:
    """x [M, K] (K a multiple of 32, rows may be strided) quantized by _quantize_x_kernel: one kernel."""
    m, k = x.shape
    qx = empty_quantized(m, k, x.device)
    _quantize_x_kernel[(triton.cdiv(k // 32, QUANTIZE_BLOCKS), m)](
        x, *qx, k, x.stride(0), BLOCKS=QUANTIZE_BLOCKS, PDL=pdl, num_warps=4, **launch_options(pdl))
    return qx


def row_groups(qx: QuantizedX, out: torch.Tensor):
    """(rows, x's quantized rows, out's rows) in groups of at most MAX_ROWS: the kernels keep one accumulator a
    row."""
    m = out.shape[0]
    for r0 in range(0, m, MAX_ROWS):
        r1 = min(m, r0 + MAX_ROWS)
        yield r1 - r0, qx.rows(r0, r1), out[r0:r1]


def q4k_rows_into(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  pdl: bool = False, tiles: Q4kTiles | None = None, qx: QuantizedX | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W the Q4_K blocks [N, 144 K / 256] uint8; out's and x's columns
    contiguous, their rows may be strided. qx: x already quantized (quantize_x), else it is here."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    (m, k), n = x.shape, blocks.shape[0]
    assert k % SUPER_BLOCK == 0 and blocks.shape[1] == k // SUPER_BLOCK * 144 and out.shape == (m, n)
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.stride(-1) == 1
    tiles = tiles or Q4kTiles()
    words = blocks.view(torch.int32)
    qx = qx if qx is not None else quantize_x(x, pdl)
    for rows, q, outs in row_groups(qx, out):
        _q4k_row_kernel[(triton.cdiv(n, tiles.block_n),)](
            q.xq, q.dx, q.sx, q.cx, words, bias if bias is not None else q.dx, outs, n, k // 8, words.shape[1],
            outs.stride(0), ROWS=rows, BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_j,
            EVEN=k // 8 % tiles.block_j == 0, HAS_BIAS=bias is not None, PDL=pdl, ASM=not KERNELS_INTERPRETED,
            num_warps=tiles.num_warps, **launch_options(pdl))
