"""Activations times Q6_K or Q8_0 rows as integer dot products: the two GGUF types whose blocks (210 and 34 bytes)
leave every other block only 2-byte aligned in the file. On the device Q6_K's blocks are padded to 224 bytes and
Q8_0's rows are planar (kernels/gguf_linear.py), so both load their words 16 bytes at a time. The quantized
activations, the dp4a and the row handling are kernels/gguf_int8_dot.py's (its docstring says why and how). Q4_K_M
files mix Q6_K in. Both are default paths where gguf_int8_dot.INT8_DOT_ROWS says.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.gguf_int8_dot import (SUPER_BLOCK, QuantizedX, dp4a, dp4a_signed, group_sums, load_words,
                                            program_rows, quantize_x, row_groups, store_rows)
from ostinato.kernels.gguf_linear import Q6_K, device_row_bytes
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)


# Q6_K: 256 weights in 210 bytes: ql[128] (low four bits), qh[64] (high two), sixteen int8 scales (one a
# 16-weight sub-block), d. Half h of a super-block is weights 128h..: for l in 0..31, ql byte 64h + l holds
# quarter 0's weight l (low nibble) and quarter 2's (high), ql byte 64h + 32 + l quarters 1 and 3, and qh byte
# 32h + l the top two bits of all four (bits 2t, 2t + 1 for quarter t); quarter t's weight l has scale
# 8h + 2t + l // 16. A word of four ql bytes thus makes four weights of two quarters, contiguous in K, and one
# qh word completes four of each quarter: a *position* (h, w) of a super-block is words w of ql's two halves and
# of qh, 16 weights, all of one sub-block per quarter. On the device a block is 224 bytes, 56 words (14 bytes of
# padding after d: gguf_linear.device_rows). Where a tile gives each thread 4 positions (Q6K_ONE_ROW), they are
# one run, w = 4i..4i + 3: 16 aligned bytes of each of the three, loaded at once, and one sub-block of each
# quarter, summed without the other threads.
@dataclass(frozen=True)
class Q6kTiles:
    """A program's share: block_n rows of W, K walked block_j positions (16 weights each) at a time. The default
    at 2-8 rows; Q6K_ONE_ROW at one."""

    block_n: int = 2
    block_j: int = 64
    num_warps: int = 4


# At one row 4 positions a thread: whole 8B decode steps ran faster with it than the 16-bit halves of the file's
# blocks did; at 4 rows neither it nor the other tiles tried beat the default (docs/PERFORMANCE.md, GGUF).
Q6K_ONE_ROW = Q6kTiles(block_n=4, block_j=128)


def q6k_tiles(m: int) -> Q6kTiles:
    """The default tiles at m rows."""
    return Q6K_ONE_ROW if m == 1 else Q6kTiles()


@_jit
def _q6k_tile(w_rows, j0, offs_j, n_pos, EVEN: tl.constexpr):
    """Positions j0 + offs_j of each row: (ql word w of half h, ql word w + 8, qh word w), [BLOCK_N, BLOCK_J]."""
    block = (j0 // 16) * 56 + (offs_j // 16) * 56 + offs_j % 8
    half = (offs_j % 16) // 8
    # Runs of 4 words from a multiple of 4, which the compiler cannot prove from the // and %: so it loads each
    # run as one 16-byte word.
    ql = tl.max_contiguous(tl.multiple_of(block + 16 * half, 4), 4)[None, :]
    qh = tl.max_contiguous(tl.multiple_of(block + 8 * half + 32, 4), 4)[None, :]
    mask = (j0 + offs_j < n_pos)[None, :]
    return load_words(w_rows + ql, mask, EVEN), load_words(w_rows + ql + 8, mask, EVEN), \
        load_words(w_rows + qh, mask, EVEN)


@_jit
def _q6k_quarter(x_words, q, mask, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr,
                 ASM: tl.constexpr):
    """Quarter codes q (0..63, four a word) times x's words at x_words, summed over each 4 positions (a
    sub-block): [BLOCK_N, GROUPS]."""
    return group_sums(dp4a(q, load_words(x_words, mask, EVEN), 0, ASM), BLOCK_N, GROUPS, 4)


@_jit
def _q6k_row_part(xq_ptr, dx_ptr, s16_ptr, r, n_pos, x_words, j_mask, q0, q1, q2, q3, sc0, sc1, sc2, sc3, at16,
                  at32, g_mask, GROUPS: tl.constexpr, BLOCK_N: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """Row r of x times this K step's four quarters of codes (q0..q3) under their sub-blocks' scales (sc0..sc3):
    [BLOCK_N, GROUPS], before d. xq's rows are K / 4 = 4 n_pos words, dx's K / 32 = n_pos / 2, s16's n_pos."""
    xw = xq_ptr + r * (4 * n_pos) + x_words
    s16_r = s16_ptr + r * n_pos + at16
    dx_r = dx_ptr + r * (n_pos // 2) + at32
    part = sc0 * tl.load(dx_r, mask=g_mask, other=0.0) * (
        _q6k_quarter(xw, q0, j_mask, GROUPS, BLOCK_N, EVEN, ASM) - 32.0 * tl.load(s16_r, mask=g_mask, other=0.0))
    part += sc1 * tl.load(dx_r + 1, mask=g_mask, other=0.0) * (
        _q6k_quarter(xw + 8, q1, j_mask, GROUPS, BLOCK_N, EVEN, ASM) - 32.0 * tl.load(s16_r + 2, mask=g_mask,
                                                                                     other=0.0))
    part += sc2 * tl.load(dx_r + 2, mask=g_mask, other=0.0) * (
        _q6k_quarter(xw + 16, q2, j_mask, GROUPS, BLOCK_N, EVEN, ASM) - 32.0 * tl.load(s16_r + 4, mask=g_mask,
                                                                                      other=0.0))
    part += sc3 * tl.load(dx_r + 3, mask=g_mask, other=0.0) * (
        _q6k_quarter(xw + 24, q3, j_mask, GROUPS, BLOCK_N, EVEN, ASM) - 32.0 * tl.load(s16_r + 6, mask=g_mask,
                                                                                      other=0.0))
    return part


@_jit
def _scale(scale_at, t, g_mask):
    return tl.load(scale_at + 2 * t, mask=g_mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@_jit
def _q6k_row_kernel(xq_ptr, dx_ptr, s16_ptr, w_ptr, b8_ptr, b_ptr, out_ptr, N, n_pos, row_words, stride_om,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr,
                    HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """out [ROWS, N] = x W^T: W's rows as words at w_ptr and as bytes at b8_ptr (the same memory); x as
    quantize_x gives it. A group of 4 positions is one sub-block of each quarter: its dp4a sums take the
    sub-block's scale, and the codes' offset of 32 comes off as 32 times the sub-block's sum of x codes."""
    q6k_rows(tl.program_id(0), xq_ptr, dx_ptr, s16_ptr, w_ptr, b8_ptr, b_ptr, out_ptr, N, n_pos, row_words, stride_om,
             ROWS, BLOCK_N, BLOCK_J, EVEN, HAS_BIAS, PDL, ASM)


@_jit
def q6k_rows(program, xq_ptr, dx_ptr, s16_ptr, w_ptr, b8_ptr, b_ptr, out_ptr, N, n_pos, row_words, stride_om,
             ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr,
             HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """_q6k_row_kernel's work for its program `program` (kernels/gguf_int8_mixed.py launches it beside another
    type's rows)."""
    pdl_begin(PDL)
    GROUPS: tl.constexpr = BLOCK_J // 4
    offs_n, rows, w_rows = program_rows(w_ptr, row_words, N, BLOCK_N, program)
    b_rows = b8_ptr + rows.to(tl.int64)[:, None] * (4 * row_words)
    offs_j = tl.arange(0, BLOCK_J)
    # x's word for quarter 0 of position j: super-block j // 16 (64 words), half (32), word j % 8 (+ 8 a quarter)
    x_at = tl.max_contiguous(tl.multiple_of((offs_j // 16) * 64 + ((offs_j % 16) // 8) * 32 + offs_j % 8, 4), 4)
    x_at = x_at[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
    g = tl.arange(0, GROUPS)[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)  # group: super-block g // 4, half
    # (g % 4) // 2, sub-block g % 2 of each quarter
    a_next, b_next, h_next = _q6k_tile(w_rows, 0, offs_j, n_pos, EVEN)
    pdl_wait(PDL)
    acc0 = tl.zeros([BLOCK_N, GROUPS], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for j0 in range(0, n_pos, BLOCK_J):
        a, b, hb = a_next, b_next, h_next
        a_next, b_next, h_next = _q6k_tile(w_rows, tl.minimum(j0 + BLOCK_J, n_pos - BLOCK_J) if EVEN else
                                           j0 + BLOCK_J, offs_j, n_pos, EVEN)
        x_words = (j0 // 16) * 64 + x_at
        j_mask = j0 + offs_j[None, :] < n_pos
        gg = j0 // 4 + g
        g_mask = gg < n_pos // 4
        sb = gg // 4
        half = (gg % 4) // 2
        # x's 16-block for quarter t: 16 sb + 8 half + 2 t + g % 2; its 32-block: 8 sb + 4 half + t
        at16 = 16 * sb + 8 * half + gg % 2
        at32 = 8 * sb + 4 * half
        scale_at = b_rows + sb * 224 + 192 + 8 * half + gg % 2  # quarter t's int8 scale at + 2t
        d = tl.load((b_rows + sb * 224 + 208).to(tl.pointer_type(tl.float16)), mask=g_mask, other=0.0).to(tl.float32)
        q0 = (a & 0x0F0F0F0F) | ((hb << 4) & 0x30303030)
        q1 = (b & 0x0F0F0F0F) | ((hb << 2) & 0x30303030)
        q2 = ((a >> 4) & 0x0F0F0F0F) | (hb & 0x30303030)
        q3 = ((b >> 4) & 0x0F0F0F0F) | ((hb >> 2) & 0x30303030)
        sc0 = _scale(scale_at, 0, g_mask)
        sc1 = _scale(scale_at, 1, g_mask)
        sc2 = _scale(scale_at, 2, g_mask)
        sc3 = _scale(scale_at, 3, g_mask)
        acc0 += d * _q6k_row_part(xq_ptr, dx_ptr, s16_ptr, 0, n_pos, x_words, j_mask, q0, q1, q2, q3, sc0, sc1, sc2,
                                  sc3, at16, at32, g_mask, GROUPS, BLOCK_N, EVEN, ASM)
        if ROWS > 1:
            acc1 += d * _q6k_row_part(xq_ptr, dx_ptr, s16_ptr, 1, n_pos, x_words, j_mask, q0, q1, q2, q3, sc0, sc1,
                                      sc2, sc3, at16, at32, g_mask, GROUPS, BLOCK_N, EVEN, ASM)
        if ROWS > 2:
            acc2 += d * _q6k_row_part(xq_ptr, dx_ptr, s16_ptr, 2, n_pos, x_words, j_mask, q0, q1, q2, q3, sc0, sc1,
                                      sc2, sc3, at16, at32, g_mask, GROUPS, BLOCK_N, EVEN, ASM)
        if ROWS > 3:
            acc3 += d * _q6k_row_part(xq_ptr, dx_ptr, s16_ptr, 3, n_pos, x_words, j_mask, q0, q1, q2, q3, sc0, sc1,
                                      sc2, sc3, at16, at32, g_mask, GROUPS, BLOCK_N, EVEN, ASM)
    store_rows(out_ptr, acc0, acc1, acc2, acc3, stride_om, b_ptr, rows, offs_n, N, ROWS, HAS_BIAS)


def q6k_rows_into(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  pdl: bool = False, tiles: Q6kTiles | None = None, qx: QuantizedX | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W the Q6_K blocks padded to 224 bytes [N, 224 K / 256] uint8; out's
    and x's columns contiguous, their rows may be strided. qx: x already quantized (quantize_x), else it is here."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    (m, k), n = x.shape, blocks.shape[0]
    assert k % SUPER_BLOCK == 0 and blocks.shape[1] == device_row_bytes(Q6_K, k) and out.shape == (m, n)
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.stride(-1) == 1
    tiles = tiles or q6k_tiles(m)
    words = blocks.view(torch.int32)
    n_pos = k // 16
    qx = qx if qx is not None else quantize_x(x, pdl)
    for rows, q, outs in row_groups(qx, out):
        _q6k_row_kernel[(triton.cdiv(n, tiles.block_n),)](
            q.xq, q.dx, q.s16, words, blocks, bias if bias is not None else q.dx, outs, n, n_pos, words.shape[1],
            outs.stride(0), ROWS=rows, BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_j,
            EVEN=n_pos % tiles.block_j == 0, HAS_BIAS=bias is not None, PDL=pdl, ASM=not KERNELS_INTERPRETED,
            num_warps=tiles.num_warps, **launch_options(pdl))


# Q8_0: 32 weights a block, an fp16 scale d and 32 int8 codes: w = d * q; a planar row holds all codes (K bytes),
# then every block's d. The codes meet x's in x's own order (code word w is x's word w), signed by signed; a
# block's 8 dp4a sums take d * dx once.
@dataclass(frozen=True)
class Q8Tiles:
    """A program's share: block_n rows of W, K walked block_j code words (4 weights each) at a time. The default
    at 2-8 rows; Q8_ONE_ROW at one."""

    block_n: int = 4
    block_j: int = 128
    num_warps: int = 4


# At one row a K step of 1 KB of each row's codes: whole 8B decode steps ran faster with it than with the
# default's 512 bytes, and slower at 4 and 8 rows, where every K step also loads each row's x words
# (docs/PERFORMANCE.md, GGUF). The kernel-alone sweep ranks the tiles otherwise, so the steps decided.
Q8_ONE_ROW = Q8Tiles(block_j=256)


def q8_tiles(m: int) -> Q8Tiles:
    """The default tiles at m rows."""
    return Q8_ONE_ROW if m == 1 else Q8Tiles()


@_jit
def _row_length(row_len, QUADS: tl.constexpr):
    """A row's length in words: row_len itself, or with QUADS 4 * row_len, which tells the compiler that every row
    starts 16-byte aligned (it assumes no alignment from a length that is not a multiple of 16)."""
    if QUADS:
        return row_len * 4
    else:
        return row_len


def _row_words(blocks: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """Planar rows [N, row_bytes] uint8 (row_bytes a multiple of 4) as int32 words, and the kernels' row_len and
    QUADS (_row_length)."""
    words = blocks.view(torch.int32)
    quads = words.shape[1] % 4 == 0
    return words, words.shape[1] // 4 if quads else words.shape[1], quads


@_jit
def _q80_part(xq_ptr, dx_ptr, r, n_words, j0, offs_j, j_mask, w, blk, g_mask, dw, BLOCK_N: tl.constexpr,
              BLOCKS: tl.constexpr, EVEN: tl.constexpr, ASM: tl.constexpr):
    """Row r of x times this K step's codes w, each block's sum scaled by d * dx: [BLOCK_N, BLOCKS]. xq's rows
    are n_words words, dx's n_words / 8."""
    x_words = xq_ptr + r * n_words + j0 + offs_j[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)  # rows alike
    sums = group_sums(dp4a_signed(w, load_words(x_words, j_mask, EVEN), 0, ASM), BLOCK_N, BLOCKS, 8)
    return dw * tl.load(dx_ptr + r * (n_words // 8) + blk, mask=g_mask, other=0.0) * sums


@_jit
def _q80_codes(w_rows, j0, offs_j, n_words, EVEN: tl.constexpr):
    """Code words j0 + offs_j of each row, [BLOCK_N, BLOCK_J]: contiguous, 16 bytes a load."""
    return load_words(w_rows + j0 + offs_j[None, :], (j0 + offs_j < n_words)[None, :], EVEN)


@_jit
def _q80_row_kernel(xq_ptr, dx_ptr, w_ptr, b_ptr, out_ptr, N, n_words, row_len, stride_om,
                    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, EVEN: tl.constexpr,
                    QUADS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """out [ROWS, N] = x W^T, W's planar rows as int32 words at w_ptr (row_len: _row_length), x as quantize_x gives
    it."""
    pdl_begin(PDL)
    BLOCKS: tl.constexpr = BLOCK_J // 8
    row_words = _row_length(row_len, QUADS)
    offs_n, rows, w_rows = program_rows(w_ptr, row_words, N, BLOCK_N, tl.program_id(0))
    d_rows = (w_rows + n_words).to(tl.pointer_type(tl.float16))  # each block's d, after the codes
    offs_j = tl.arange(0, BLOCK_J)
    offs_b = tl.arange(0, BLOCKS)[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)
    w_next = _q80_codes(w_rows, 0, offs_j, n_words, EVEN)  # weights only: requested before the wait
    pdl_wait(PDL)
    acc0 = tl.zeros([BLOCK_N, BLOCKS], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for j0 in range(0, n_words, BLOCK_J):
        w = w_next
        # The next tile, or at the end this one again (in bounds, never used).
        w_next = _q80_codes(w_rows, tl.minimum(j0 + BLOCK_J, n_words - BLOCK_J) if EVEN else j0 + BLOCK_J, offs_j,
                            n_words, EVEN)
        j_mask = j0 + offs_j[None, :] < n_words
        blk = j0 // 8 + offs_b
        g_mask = blk < n_words // 8
        dw = tl.load(d_rows + blk, mask=g_mask, other=0.0).to(tl.float32)
        acc0 += _q80_part(xq_ptr, dx_ptr, 0, n_words, j0, offs_j, j_mask, w, blk, g_mask, dw, BLOCK_N, BLOCKS,
                          EVEN, ASM)
        if ROWS > 1:
            acc1 += _q80_part(xq_ptr, dx_ptr, 1, n_words, j0, offs_j, j_mask, w, blk, g_mask, dw, BLOCK_N, BLOCKS,
                              EVEN, ASM)
        if ROWS > 2:
            acc2 += _q80_part(xq_ptr, dx_ptr, 2, n_words, j0, offs_j, j_mask, w, blk, g_mask, dw, BLOCK_N, BLOCKS,
                              EVEN, ASM)
        if ROWS > 3:
            acc3 += _q80_part(xq_ptr, dx_ptr, 3, n_words, j0, offs_j, j_mask, w, blk, g_mask, dw, BLOCK_N, BLOCKS,
                              EVEN, ASM)
    store_rows(out_ptr, acc0, acc1, acc2, acc3, stride_om, b_ptr, rows, offs_n, N, ROWS, HAS_BIAS)


def q80_rows_into(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                  pdl: bool = False, tiles: Q8Tiles | None = None, qx: QuantizedX | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W the planar Q8_0 rows [N, 34 K / 32] uint8 (K a multiple of 64:
    rows of whole words); out's and x's columns contiguous, their rows may be strided. qx: x already quantized
    (quantize_x), else it is here."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    (m, k), n = x.shape, blocks.shape[0]
    assert k % 64 == 0 and blocks.shape[1] == k // 32 * 34 and out.shape == (m, n)
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.stride(-1) == 1
    tiles = tiles or q8_tiles(m)
    words, row_len, quads = _row_words(blocks)
    n_words = k // 4
    qx = qx if qx is not None else quantize_x(x, pdl)
    for rows, q, outs in row_groups(qx, out):
        _q80_row_kernel[(triton.cdiv(n, tiles.block_n),)](
            q.xq, q.dx, words, bias if bias is not None else q.dx, outs, n, n_words, row_len, outs.stride(0),
            ROWS=rows, BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_j, EVEN=n_words % tiles.block_j == 0,
            QUADS=quads, HAS_BIAS=bias is not None, PDL=pdl, ASM=not KERNELS_INTERPRETED, num_warps=tiles.num_warps,
            **launch_options(pdl))
