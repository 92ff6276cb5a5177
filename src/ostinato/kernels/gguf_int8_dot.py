"""Activations times GGUF blocks as integer dot products: what the Q4_K kernels (kernels/gguf_int8_q4k.py), the Q6_K
and Q8_0 kernels (kernels/gguf_int8_q6k_q80.py) share: the quantized activations, the dp4a, the row handling.
Q4_K_M files are Q4_K and Q6_K.

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

Two kernels a projection: the first quantizes x (int8 codes packed four to a word in x's column order, and each
32-block's dx, sum of x and cx); the second, the type's, takes BLOCK_N rows of W a program and walks K a tile of
code words at a time.

Rows: a kernel keeps one accumulator for each of up to MAX_ROWS rows of x and decodes each K step's codes and
scales once for all of them; more rows go in groups, each a pass over W (x quantized once for all groups).
gguf_gemv sends x here by default at the row counts INT8_DOT_ROWS gives each type, up to 8: above them the
projections are a GEMM's, dense slices and cuBLAS.

For bf16/fp16 activations only: float32 runs (the reference runs) keep the kernel that decodes to fp32. Against
the gguf library's dequantize-then-matmul the outputs are off by about 0.6% of their norm (the fp32 decoding's
bf16 output: 0.26%; docs/PERFORMANCE.md, GGUF): the approximation llama.cpp's mat-vec kernels make.
"""

from __future__ import annotations

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
def low_half(h):
    """The fp16 in the low 16 bits of int32 h, as float."""
    return (h & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def program_rows(w_ptr, row_len, N, BLOCK_N: tl.constexpr, program):
    """The rows of W of program `program` (tl.program_id(0) where a launch holds one projection): their output
    columns, the rows read (past N the last one, read and never stored) and pointers to them, [BLOCK_N, 1]
    (row_len: a row's length in w_ptr's elements)."""
    offs_n = program * BLOCK_N + tl.arange(0, BLOCK_N)
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
