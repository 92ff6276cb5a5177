"""Activations times Q4_K, Q6_K or Q8_0 blocks on the tensor cores: int8 MMAs for decode batches of 5 to 16 rows
(INT8_MMA_ROWS), half-precision MMAs of W decoded in registers for 17 to 64 (HALF_MMA_ROWS).

Why: the dp4a kernels (kernels/gguf_int8_dot.py) keep one accumulator a row of x and pass over W once per four
rows, and each row costs every code word its own dp4a and x loads: at 8 rows a Q4_K_M step took 1.7x bf16's.
The dense slices (gguf_gemv.gguf_matmul_dequantized) write and read a bf16 copy of W. Here W is read once for a
tile of up to 64 rows. Up to 16 rows its codes meet x's codes on the tensor cores, as llama.cpp's MMQ kernels do:
the sub-block's int8 codes times the 32 int8 codes x has there, one MMA, exact in int32. What bounds them is the
scaling of every sub-block's sums in fp32, which grows with the rows; above 16 rows W is decoded to x's dtype
instead (scaled once per weight, whatever the rows) and multiplied with x as it is, no quantizing kernel before.

How: the product is computed transposed, acc [BLOCK_N, ROW_TILE] = W tile @ x tile^T: W's rows on the MMA's wide
side, x's rows (padded to 16) on its narrow side, as kernels/split_gemm.py does and for the same reasons, K split
over programs its way too (the last program to arrive adds the partials, split_gemm.merge_splits). A program
walks its K range a super-block (256 weights) at a time. The int8 kernels take x as quantize_x gives it (int8
codes per 32-block, each block's dx, sx and cx: gguf_int8_dot.py gives the formula); each sub-block's codes are
unpacked in registers to int8 [BLOCK_N, 32] and multiplied by one int8 tl.dot with x's 32 codes there, then
scaled in fp32:
    Q4_K  acc += d sc (dx dot + cx) - dmin mn sx      (the dp4a kernel's formula: codes centred on 8 through cx)
    Q6_K  acc += d dx (sc_a dot_a + sc_b dot_b)      (codes made signed, q - 32; its sub-blocks are 16 weights,
                                                     so each 32-block is two MMAs with the other half zeroed)
    Q8_0  acc += d dx dot                            (Q8_0's planar rows: its codes, then its scales)
The half-precision kernels decode each sub-block's weights as the torch dequantizers do (the codes turned to
float by their bits under 2^23's exponent, not by a quarter-rate conversion), round them to x's dtype and
multiply with x's 32 values there. kernels/gguf_int8_route.py dispatches. Graph safe: the grid and the split come
from the shapes alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.gguf_int8_dot import SUPER_BLOCK, QuantizedX, half_rows_within, low_half, quantize_x
from ostinato.kernels.gguf_linear import Q4_K, Q6_K, Q8_0, device_row_bytes
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.split_gemm import jit_any_m, merge_splits, split_buffers, split_steps, tile_offsets
from ostinato.kernels.triton_optional import jit, tl, triton  # noqa: F401  (tl: the kernels' annotations)

# The ggml types whose projections take these kernels by default, and at how many rows of x (first, last): below
# the first, the dp4a kernels (gguf_int8_dot.INT8_DOT_ROWS); above the last, the dense slices. Chosen by whole 8B
# decode steps (docs/PERFORMANCE.md, GGUF): faster than either at 8 and 16 rows, slower than the dp4a kernels at
# 4 and than the dense slices at 32 and 64, where the per-sub-block scaling of a 32- or 64-row tile costs more
# than the dense slices' extra bytes.
INT8_MMA_ROWS = {Q4_K: (5, 16), Q6_K: (5, 16), Q8_0: (5, 16)}
# Above them, W decoded to x's dtype: faster than the dense slices in whole 8B steps at 32 and 64 rows, slower
# than the int8 MMAs at 16 (docs/PERFORMANCE.md, GGUF). Above 64 rows (prefill) the dense slices stay.
HALF_MMA_ROWS = {Q4_K: (17, 64), Q6_K: (17, 64), Q8_0: (17, 64)}


@dataclass(frozen=True)
class MmaTiles:
    """block_n rows of W a program (the MMA's wide side); x's rows in tiles of the next power of two of the row
    count, 16 to max_row_tile; K split so that the tiles of one row tile make about split_programs programs, each
    split at least min_split_super_blocks super-blocks. num_warps at a row tile of 16, wide_num_warps above: at 4
    warps a row tile of 32 or 64 needs more registers than a thread has (ptxas spills the accumulators)."""

    block_n: int = 64
    num_warps: int = 4
    wide_num_warps: int = 8
    num_stages: int = 2
    split_programs: int = 264
    min_split_super_blocks: int = 2
    max_row_tile: int = 64
    decode_to_x: bool = False  # W decoded to x's dtype, x unquantized: half-precision MMAs (HALF_MMA_ROWS)

    def row_tile(self, m: int) -> int:
        return min(self.max_row_tile, max(16, triton.next_power_of_2(m)))

    def split(self, n: int, k: int) -> tuple[int, int]:
        """(splits, super-blocks a split) of an [N, K] weight: from N, K and the tiles only."""
        return split_steps(-(-n // self.block_n), k // SUPER_BLOCK, self.split_programs, self.min_split_super_blocks)


@jit
def _x_tile(x_cols, m_mask, k0):
    """x's 32 int8 codes from column k0 of each row, transposed: [32, ROW_TILE]."""
    return tl.load(x_cols + k0 + tl.arange(0, 32)[:, None], mask=m_mask[None, :], other=0)


@jit
def _x_stat(ptr, stat_rows, m_mask, blk):
    """One per-32-block value (dx, sx or cx) of each row at block blk: [1, ROW_TILE]."""
    return tl.load(ptr + stat_rows + blk, mask=m_mask, other=0.0)[None, :]


@jit
def _k4_scale_min(h1, h2, h3, s: tl.constexpr):
    """Sub-block s's six-bit (scale, min) from the header words h1..h3 (the twelve packed bytes: ggml's
    get_scale_min_k4 at a fixed sub-block), float [BLOCK_N, 1]."""
    if s < 4:
        sc = (h1 >> (8 * s)) & 63
        mn = (h2 >> (8 * s)) & 63
    else:
        sc = ((h3 >> (8 * (s - 4))) & 15) | (((h1 >> (8 * (s - 4) + 6)) & 3) << 4)
        mn = ((h3 >> (8 * (s - 4) + 4)) & 15) | (((h2 >> (8 * (s - 4) + 6)) & 3) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@jit
def _q4k_head(block):
    """A Q4_K block's d and dmin (float32) and the three words of its 6-bit scales and mins, [BLOCK_N, 1] each:
    144-byte blocks, so the header is 4 aligned words."""
    head = block.to(tl.pointer_type(tl.int32))
    h0 = tl.load(head)
    return low_half(h0), low_half(h0 >> 16), tl.load(head + 1), tl.load(head + 2), tl.load(head + 3)


@jit
def _q6k_half(block, h, p):
    """Half h of a Q6_K block: its ql bytes of quarters 0 and 2, of quarters 1 and 3, and its qh bytes, int32
    [BLOCK_N, 32] each (p: the byte offsets 0..31)."""
    return tl.load(block + 64 * h + p).to(tl.int32), tl.load(block + 64 * h + 32 + p).to(tl.int32), \
        tl.load(block + 128 + 32 * h + p).to(tl.int32)


@jit
def _q6k_codes(ql_a, ql_b, qh, t: tl.constexpr):
    """Quarter t's 6-bit codes (0..63) from its half's bytes."""
    ql = ql_a if t % 2 == 0 else ql_b
    nibble = (ql >> 4) if t >= 2 else (ql & 15)
    return nibble | (((qh >> (2 * t)) & 3) << 4)


@jit
def _q6k_scales(block, h, t):
    """The int8 scales of quarter t of half h: its weights 0-15, then 16-31, int32."""
    scales = block + 192 + 8 * h + 2 * t
    return tl.load(scales).to(tl.int8, bitcast=True).to(tl.int32), \
        tl.load(scales + 1).to(tl.int8, bitcast=True).to(tl.int32)


@jit
def _q4k_super_block(acc, w_rows, sb, x_cols, m_mask, stat_rows, dx_ptr, sx_ptr, cx_ptr):
    """acc + super-block sb of the Q4_K rows times x there. Byte p of code chunk c holds sub-block 2c's weight p
    (low nibble) and sub-block 2c + 1's (high)."""
    block = w_rows + sb * 144
    d, dmin, h1, h2, h3 = _q4k_head(block)
    p = tl.arange(0, 32)[None, :]
    for c in tl.static_range(4):
        codes = tl.load(block + 16 + 32 * c + p)  # [BLOCK_N, 32] uint8
        for high in tl.static_range(2):
            s = 2 * c + high
            q = (codes >> 4) if high else (codes & 15)
            dot = tl.dot(q.to(tl.int8), _x_tile(x_cols, m_mask, sb * 256 + 32 * s)).to(tl.float32)
            sc, mn = _k4_scale_min(h1, h2, h3, s)
            blk = sb * 8 + s
            acc += (d * sc) * (dot * _x_stat(dx_ptr, stat_rows, m_mask, blk) + _x_stat(cx_ptr, stat_rows, m_mask,
                                                                                        blk)) \
                - (dmin * mn) * _x_stat(sx_ptr, stat_rows, m_mask, blk)
    return acc


@jit
def _q6k_super_block(acc, w_rows, sb, x_cols, m_mask, stat_rows, dx_ptr):
    """acc + super-block sb of the Q6_K rows times x there. Half h's ql bytes 64h + l hold quarters 0 (low) and 2
    (high), 64h + 32 + l quarters 1 and 3, qh byte 32h + l the top two bits of each (bits 2t, 2t + 1);
    quarter t's weight l has scale 8h + 2t + l // 16 (gguf_int8_q6k_q80.py has the layout)."""
    block = w_rows + sb * 224  # padded on the device (gguf_linear.device_rows)
    d = tl.load((block + 208).to(tl.pointer_type(tl.float16))).to(tl.float32)  # [BLOCK_N, 1]
    p = tl.arange(0, 32)[None, :]
    first = p < 16
    for h in tl.static_range(2):
        ql_a, ql_b, qh = _q6k_half(block, h, p)
        for t in tl.static_range(4):
            q = (_q6k_codes(ql_a, ql_b, qh, t) - 32).to(tl.int8)
            x_t = _x_tile(x_cols, m_mask, sb * 256 + 128 * h + 32 * t)
            dot_a = tl.dot(tl.where(first, q, 0).to(tl.int8), x_t)
            dot_b = tl.dot(tl.where(first, 0, q).to(tl.int8), x_t)
            sc_a, sc_b = _q6k_scales(block, h, t)
            acc += (d * _x_stat(dx_ptr, stat_rows, m_mask, sb * 8 + 4 * h + t)) * (sc_a * dot_a + sc_b * dot_b).to(
                tl.float32)
    return acc


@jit
def _q80_super_block(acc, w_rows, sb, x_cols, m_mask, stat_rows, dx_ptr, K):
    """acc + the eight 32-blocks of super-block sb of the planar Q8_0 rows (K code bytes, then K / 32 fp16
    scales) times x there."""
    p = tl.arange(0, 32)[None, :]
    scales = (w_rows + K).to(tl.pointer_type(tl.float16))
    for b in tl.static_range(8):
        blk = sb * 8 + b
        q = tl.load(w_rows + 32 * blk + p).to(tl.int8, bitcast=True)
        dot = tl.dot(q, _x_tile(x_cols, m_mask, 32 * blk)).to(tl.float32)
        acc += tl.load(scales + blk).to(tl.float32) * _x_stat(dx_ptr, stat_rows, m_mask, blk) * dot
    return acc


@jit
def _as_float(q):
    """int32 q in [0, 2^23) as float, without an int-to-float conversion (a quarter-rate instruction): its bits
    under 2^23's exponent, minus 2^23."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@jit
def _x16_tile(x_cols, m_mask, k0):
    """x's 32 half-precision values from column k0 of each row, transposed: [32, ROW_TILE]."""
    return tl.load(x_cols + k0 + tl.arange(0, 32)[:, None], mask=m_mask[None, :], other=0.0)


@jit
def _q4k_half_super_block(acc, w_rows, sb, x_cols, m_mask):
    """acc + super-block sb of the Q4_K rows, decoded to x's dtype in registers, times x there (tl.dot)."""
    block = w_rows + sb * 144
    d, dmin, h1, h2, h3 = _q4k_head(block)
    p = tl.arange(0, 32)[None, :]
    for c in tl.static_range(4):
        codes = tl.load(block + 16 + 32 * c + p).to(tl.int32)
        for high in tl.static_range(2):
            s = 2 * c + high
            q = (codes >> 4) if high else (codes & 15)
            sc, mn = _k4_scale_min(h1, h2, h3, s)
            x_t = _x16_tile(x_cols, m_mask, sb * 256 + 32 * s)
            w = (_as_float(q) * (d * sc) - dmin * mn).to(x_t.dtype)
            acc = tl.dot(w, x_t, acc)
    return acc


@jit
def _q6k_half_super_block(acc, w_rows, sb, x_cols, m_mask):
    """acc + super-block sb of the Q6_K rows, decoded to x's dtype in registers, times x there (tl.dot)."""
    block = w_rows + sb * 224  # padded on the device (gguf_linear.device_rows)
    d = tl.load((block + 208).to(tl.pointer_type(tl.float16))).to(tl.float32)
    p = tl.arange(0, 32)[None, :]
    for h in tl.static_range(2):
        ql_a, ql_b, qh = _q6k_half(block, h, p)
        for t in tl.static_range(4):
            sc_a, sc_b = _q6k_scales(block, h, t)
            x_t = _x16_tile(x_cols, m_mask, sb * 256 + 128 * h + 32 * t)
            scale = d * tl.where(p < 16, sc_a, sc_b).to(tl.float32)
            w = ((_as_float(_q6k_codes(ql_a, ql_b, qh, t)) - 32.0) * scale).to(x_t.dtype)
            acc = tl.dot(w, x_t, acc)
    return acc


@jit
def _q80_half_super_block(acc, w_rows, sb, x_cols, m_mask, K):
    """acc + the eight 32-blocks of super-block sb of the planar Q8_0 rows, decoded to x's dtype, times x there."""
    p = tl.arange(0, 32)[None, :]
    scales = (w_rows + K).to(tl.pointer_type(tl.float16))
    for b in tl.static_range(8):
        blk = sb * 8 + b
        q = tl.load(w_rows + 32 * blk + p).to(tl.int8, bitcast=True).to(tl.int32)
        x_t = _x16_tile(x_cols, m_mask, 32 * blk)
        w = ((_as_float(q + 128) - 128.0) * tl.load(scales + blk).to(tl.float32)).to(x_t.dtype)
        acc = tl.dot(w, x_t, acc)
    return acc


@jit
def _range_sum(w_rows, x_cols, m_mask, stat_rows, dx_ptr, sx_ptr, cx_ptr, sb_start, sb_end, K,
               QTYPE: tl.constexpr, ROW_TILE: tl.constexpr, BLOCK_N: tl.constexpr, DECODE_TO_X: tl.constexpr):
    """The [BLOCK_N, ROW_TILE] fp32 sum over super-blocks [sb_start, sb_end), from zero."""
    acc = tl.zeros([BLOCK_N, ROW_TILE], tl.float32)
    for sb in range(sb_start, sb_end):
        if DECODE_TO_X:
            if QTYPE == 12:
                acc = _q4k_half_super_block(acc, w_rows, sb, x_cols, m_mask)
            elif QTYPE == 14:
                acc = _q6k_half_super_block(acc, w_rows, sb, x_cols, m_mask)
            else:
                acc = _q80_half_super_block(acc, w_rows, sb, x_cols, m_mask, K)
        elif QTYPE == 12:  # Q4_K
            acc = _q4k_super_block(acc, w_rows, sb, x_cols, m_mask, stat_rows, dx_ptr, sx_ptr, cx_ptr)
        elif QTYPE == 14:  # Q6_K
            acc = _q6k_super_block(acc, w_rows, sb, x_cols, m_mask, stat_rows, dx_ptr)
        else:  # Q8_0
            acc = _q80_super_block(acc, w_rows, sb, x_cols, m_mask, stat_rows, dx_ptr, K)
    return acc


@jit_any_m
def _gguf_mma_kernel(xq_ptr, dx_ptr, sx_ptr, cx_ptr, w_ptr, b_ptr, out_ptr, part_ptr, counters_ptr, M, N, K,
                row_bytes, stride_xm, stride_om, stride_ps, stride_pm, SB_PER_SPLIT, SPLITS, QTYPE: tl.constexpr,
                ROW_TILE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, PARALLEL: tl.constexpr,
                DECODE_TO_X: tl.constexpr, PDL: tl.constexpr):
    """out [M, N] = x W^T for W's GGUF rows at w_ptr (uint8), x as quantize_x gives it (xq_ptr: its codes as
    int8 [M, K]). PARALLEL: program (n, m, s) sums split s and the last to arrive adds the splits; else program
    (n, m) sums all of K."""
    pdl_begin(PDL)
    offs_n, offs_m, n_mask, m_mask, tile_mask = tile_offsets(N, M, BLOCK_N, ROW_TILE)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * row_bytes  # past N: the last row, unstored
    x_cols = xq_ptr + offs_m.to(tl.int64)[None, :] * stride_xm
    stat_rows = offs_m.to(tl.int64) * (K // 32)
    pdl_wait(PDL)
    if PARALLEL:
        sb_start = tl.program_id(2) * SB_PER_SPLIT
        acc = _range_sum(w_rows, x_cols, m_mask, stat_rows, dx_ptr, sx_ptr, cx_ptr, sb_start,
                         tl.minimum(sb_start + SB_PER_SPLIT, K // 256), K, QTYPE, ROW_TILE, BLOCK_N, DECODE_TO_X)
        last, acc = merge_splits(acc, part_ptr, counters_ptr, offs_m, offs_n, tile_mask, stride_ps, stride_pm,
                                 SPLITS)
    else:
        acc = _range_sum(w_rows, x_cols, m_mask, stat_rows, dx_ptr, sx_ptr, cx_ptr, 0, K // 256, K, QTYPE,
                         ROW_TILE, BLOCK_N, DECODE_TO_X)
        last = True
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        out = out_ptr + offs_m.to(tl.int64)[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


HALF_MMA = MmaTiles(decode_to_x=True)


def half_mma_applies(x: torch.Tensor, qtype: int) -> bool:
    """Whether gguf_linear_into sends x times qtype's blocks to the half-precision MMAs by default: half-precision
    rows, as many as HALF_MMA_ROWS gives the type, K whole super-blocks."""
    return half_rows_within(x, HALF_MMA_ROWS.get(qtype), SUPER_BLOCK)


def int8_mma_applies(x: torch.Tensor, qtype: int) -> bool:
    """Whether gguf_linear_into sends x times qtype's blocks here by default: half-precision rows, as many as
    INT8_MMA_ROWS gives the type, K whole super-blocks."""
    return half_rows_within(x, INT8_MMA_ROWS.get(qtype), SUPER_BLOCK)


def mma_rows_into(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None, out: torch.Tensor,
                  pdl: bool = False, tiles: MmaTiles | None = None, qx: QuantizedX | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W qtype's rows [N, row_bytes] uint8 (Q8_0's planar: gguf_linear.
    device_rows), K a multiple of 256; out's and x's columns contiguous, their rows may be strided. qx: x
    already quantized (quantize_x), else it is here, unless the tiles decode W to x's dtype."""
    (m, k), n = x.shape, blocks.shape[0]
    assert qtype in (Q4_K, Q6_K, Q8_0) and k % SUPER_BLOCK == 0 and out.shape == (m, n)
    assert blocks.shape[1] == device_row_bytes(qtype, k)
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.stride(-1) == 1
    tiles = tiles or MmaTiles()
    if tiles.decode_to_x:  # x as it is; these kernels read no 32-block statistics, so x fills their slots unread
        xs, stride_xm, stats = x, x.stride(0), (x, x, x)
    else:
        qx = qx if qx is not None else quantize_x(x, pdl)
        assert qx.xq.is_contiguous() and qx.dx.stride(0) == k // 32
        xs, stride_xm, stats = qx.xq.view(torch.int8), k, (qx.dx, qx.sx, qx.cx)
    splits, per_split = tiles.split(n, k)
    row_tile = tiles.row_tile(m)
    n_tiles, m_tiles = triton.cdiv(n, tiles.block_n), triton.cdiv(m, row_tile)
    parallel, partials, counters = split_buffers(out, splits, n_tiles, m_tiles, tiles.split_programs)
    _gguf_mma_kernel[(n_tiles, m_tiles, splits if parallel else 1)](
        xs, *stats, blocks, bias if bias is not None else stats[0], out, partials,
        counters, m, n, k, blocks.shape[1], stride_xm, out.stride(0), partials.stride(0), partials.stride(1),
        per_split, splits, QTYPE=qtype, ROW_TILE=row_tile, BLOCK_N=tiles.block_n, HAS_BIAS=bias is not None,
        PARALLEL=parallel, DECODE_TO_X=tiles.decode_to_x, PDL=pdl,
        num_warps=tiles.num_warps if row_tile <= 16 else tiles.wide_num_warps, num_stages=tiles.num_stages,
        **launch_options(pdl))
