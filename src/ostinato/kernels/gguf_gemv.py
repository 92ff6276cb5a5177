"""Triton kernels that read GGUF blocks (kernels/gguf_linear.py gives the formats) and decode them in registers.

Why: the decode step of a quantized model should read the quantized bytes once, at HBM speed, not a bf16 copy.

How a program reads W: by whole blocks, as llama.cpp's mat-vec kernels do. K is cut into *groups* (GROUP_K
weights: a Q8_0/Q4_0/Q4_1 block, a 64-weight chunk of a Q4_K/Q5_K super-block, a quarter of a Q6_K one); a K
step takes GROUPS groups of BLOCK_N rows and loads each group's code bytes as one contiguous [PIECE] vector (Q4_K:
the 32 bytes of a chunk, 16-byte loads), its scales once per group ([BLOCK_N, GROUPS, 1], broadcast over the
bytes). The bytes unpack in registers into *pieces* of PIECE weights that are contiguous in K (Q4_K: low nibbles
-> weights 64c..64c+31, high nibbles -> 64c+32..): x is loaded at those columns, so W is never reordered.
Modes (MODE), one kernel:
    - GEMV (a few rows): per row of x, fp32 products summed over each piece, accumulated per (row of W, group, row
      of x) across K and summed over the groups once at the end. x is loaded at the piece's own shape (every row
      of W reads the same columns, from L1) so that it shares the code bytes' register layout: a [GROUPS, PIECE]
      tile of x gets a layout of its own, and converting it each step goes through shared memory at several
      times the bytes the step reads from HBM.
    - GEMM (more rows, prefill): each piece, rounded to the activation dtype, feeds tl.dot (tensor cores).
    - DEQUANT: each piece is stored, rounded to the activation dtype, into a dense weight (gguf_linear_into above
      GEMV_MAX_ROWS: a slice of W at a time, then cuBLAS).
With PDL (kernels/pdl.py) the kernel lets its dependent launch at once and waits before its K loop: the loop
reads weights and activations together. Grids come from shapes only: CUDA-graph safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ostinato.kernels.gguf_int8_dot import QuantizedX, quantize_x
from ostinato.kernels.gguf_int8_input import glu_quantize_x, norm_quantize_x
from ostinato.kernels.gguf_int8_mixed import q4k_then_q6k_into
from ostinato.kernels.gguf_int8_route import Int8Tiles, block_kernel_into, takes_int8_dot, takes_quantized_x
from ostinato.kernels.gguf_linear import KERNEL_TYPES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0, KernelParts
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

GEMV_MAX_ROWS = 8
GEMV, GEMM, DEQUANT = 0, 1, 2
# Above GEMV_MAX_ROWS the product is not made by the GEMM mode (each weight decoded inside a tensor-core GEMM) but
# by decoding a slice of W's rows into a dense scratch of the activation dtype and multiplying it with torch.mm
# (cuBLAS). Why: the GEMM mode decodes every weight once per BLOCK_M rows of x, into a layout tl.dot then converts
# through shared memory, and runs far below cuBLAS; the dense slice costs one write and one read of 2 bytes a
# weight, which cuBLAS's speed repays from a few rows on. The figures: docs/PERFORMANCE.md. The GEMM mode stays
# for given tiles (the benchmark times it beside the dense slices).
# The dense scratch holds at most this many bytes (whole rows, at least 64): W is made in slices of that many
# rows, so a large projection (gate|up, lm_head) never needs its whole dense copy.
DEQUANT_SCRATCH_BYTES = 64 << 20
DEQUANT_BLOCK_N = 8
# Per type: (GROUP_K weights a group, PIECE weights a piece, pieces a group).
GROUPING = {Q8_0: (32, 32, 1), Q4_0: (32, 16, 2), Q4_1: (32, 16, 2), Q4_K: (64, 32, 2), Q5_K: (64, 32, 2),
            Q6_K: (64, 16, 4)}


@dataclass(frozen=True)
class GGUFTiles:
    """A program's share: block_m rows of x (the GEMV modes: all of them, padded) by block_n rows of W, K walked
    groups groups (GROUPING) at a time."""

    block_m: int
    block_n: int
    groups: int
    num_warps: int = 4
    num_stages: int = 3

    def mode(self) -> int:
        return GEMM if self.block_m >= 16 else GEMV


def choose_tiles(qtype: int, m: int, n: int, k: int) -> GGUFTiles:
    """Tiles from shapes only (fixed before capture). GEMV rows: ~1024 weights of a row per K step, as the bf16
    GEMV's BLOCK_K (kernels/gemv.py); half that at several rows, each of which costs the
    step another pass over the decoded weights. GEMM rows: 64 columns of K per tensor-core dot."""
    group_k, piece, _ = GROUPING[qtype]
    if m <= GEMV_MAX_ROWS:
        block_n = 4 if n >= 4096 else 2
        groups = 1024 // group_k if m == 1 else 512 // group_k
        return GGUFTiles(triton.next_power_of_2(m), block_n, groups)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    return GGUFTiles(block_m, 64, max(1, 64 // piece))


@_jit
def _u8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@_jit
def _i8(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@_jit
def _f16(ptr, mask):
    """The fp16 at ptr, a uint8 pointer: every fp16 field of every type sits at an even offset of an even-sized
    block in an even-sized row, so it is one aligned 2-byte load."""
    return tl.load(ptr.to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)


@_jit
def _scale_min_k4(sc_ptr, s, mask):
    """Sub-block s's six-bit (scale, min) from the 12 packed bytes at sc_ptr (ggml's get_scale_min_k4)."""
    a = _u8(sc_ptr + s, mask)  # q[s]
    b = _u8(sc_ptr + s + 4, mask)  # q[s + 4]
    c = _u8(sc_ptr + tl.where(s >= 4, s - 4, s), mask)  # q[s - 4]
    sc = tl.where(s < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(s < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@_jit
def _use(acc, w, ks, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE: tl.constexpr, PRECISION: tl.constexpr):
    """acc plus the piece w [BLOCK_N, GROUPS, PIECE] (fp32 weights) times x's columns ks [GROUPS, PIECE]. In
    DEQUANT mode x is the dense weight being written instead: w stored at its rows offs_m (W's rows, [BLOCK_N],
    in range where m_mask), columns ks; acc is returned as it came."""
    k_mask = ks < K
    if MODE == 2:
        at = x_ptr + offs_m.to(tl.int64)[:, None, None] * stride_xm + ks[None, :, :]
        tl.store(at, w.to(x_ptr.dtype.element_ty), mask=m_mask[:, None, None] & k_mask[None, :, :])
    elif MODE == 0:  # GEMV: acc [BLOCK_N, GROUPS, BLOCK_M]
        rows: tl.constexpr = acc.shape[2]
        at_w = ks[None, :, :] + tl.zeros([w.shape[0], 1, 1], tl.int32)  # x's columns at w's shape
        for m in tl.static_range(rows):
            x_mask = k_mask[None, :, :] & (tl.full([1, 1, 1], m, tl.int32) < M)
            x = tl.load(x_ptr + m * stride_xm + at_w, mask=x_mask, other=0.0).to(tl.float32)
            part = tl.sum(w * x, axis=2)[:, :, None]
            if rows == 1:
                acc += part
            else:
                acc += tl.where(tl.arange(0, rows)[None, None, :] == m, part, 0.0)
    else:  # GEMM: acc [BLOCK_M, BLOCK_N]
        width: tl.constexpr = w.shape[1] * w.shape[2]
        cols = tl.reshape(ks, [width])
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_mask[:, None] & (cols < K)[None, :],
                    other=0.0)
        wt = tl.reshape(w, [w.shape[0], width]).to(x.dtype)
        acc = tl.dot(x, tl.trans(wt), acc, input_precision=PRECISION)
    return acc


@_jit
def _step(acc, row, mask, g2, l2, x_ptr, stride_xm, offs_m, m_mask, M, K,
          QTYPE: tl.constexpr, MODE: tl.constexpr, PRECISION: tl.constexpr):
    """acc plus groups g2 [GROUPS, 1] of the rows at row [BLOCK_N, 1, 1] (mask [BLOCK_N, GROUPS, 1]: row and
    group in range; tl.load broadcasts it over a group's bytes, so it stays constant along them and the byte
    loads can be vectors) times x. l2 [1, PIECE]: a byte's place in its group's code vector."""
    g = g2[None, :, :]  # [1, GROUPS, 1]
    l = l2[None, :, :]  # [1, 1, PIECE]
    if QTYPE == 8:  # Q8_0: a group is a block; planar rows (kernels/gguf_linear.py): K codes, then each d
        w = _f16(row + K + 2 * g, mask) * _i8(row + 32 * g + l, mask)
        acc = _use(acc, w, g2 * 32 + l2, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0, Q4_1: a group is a block; low nibbles weights 0..15, high 16..31
        if QTYPE == 2:
            blk = row + g * 18
            q = _u8(blk + 2 + l, mask)
            d = _f16(blk, mask)
            lo = d * ((q & 15).to(tl.float32) - 8.0)
            hi = d * ((q >> 4).to(tl.float32) - 8.0)
        else:
            blk = row + g * 20
            q = _u8(blk + 4 + l, mask)
            d = _f16(blk, mask)
            mn = _f16(blk + 2, mask)
            lo = d * (q & 15).to(tl.float32) + mn
            hi = d * (q >> 4).to(tl.float32) + mn
        acc = _use(acc, lo, g2 * 32 + l2, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
        acc = _use(acc, hi, g2 * 32 + 16 + l2, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: a group is chunk c of super-block sb (sub-blocks 2c, 2c+1)
        sb = g // 4
        c = g % 4
        if QTYPE == 12:
            blk = row + sb * 144
            q = _u8(blk + 16 + 32 * c + l, mask)
            lo = q & 15
            hi = q >> 4
        else:
            blk = row + sb * 176
            q = _u8(blk + 48 + 32 * c + l, mask)
            qh = _u8(blk + 16 + l, mask)  # bit 2c: the low nibble's fifth bit, 2c + 1: the high one's
            lo = (q & 15) | (((qh >> (2 * c)) & 1) << 4)
            hi = (q >> 4) | (((qh >> (2 * c + 1)) & 1) << 4)
        d = _f16(blk, mask)
        dmin = _f16(blk + 2, mask)
        sc0, mn0 = _scale_min_k4(blk + 4, 2 * c, mask)
        sc1, mn1 = _scale_min_k4(blk + 4, 2 * c + 1, mask)
        acc = _use(acc, d * sc0 * lo.to(tl.float32) - dmin * mn0, g2 * 64 + l2, x_ptr, stride_xm, offs_m, m_mask,
                   M, K, MODE, PRECISION)
        acc = _use(acc, d * sc1 * hi.to(tl.float32) - dmin * mn1, g2 * 64 + 32 + l2, x_ptr, stride_xm, offs_m,
                   m_mask, M, K, MODE, PRECISION)
    else:  # Q6_K: a group is half h of super-block sb, columns 16u..16u+15 of its four quarters t
        sb = g // 4
        h = (g // 2) % 2
        u = g % 2
        blk = row + sb * 224  # blocks padded on the device (gguf_linear.device_rows)
        qa = _u8(blk + 64 * h + 16 * u + l, mask)  # quarters 0 (low nibbles) and 2 (high)
        qb = _u8(blk + 64 * h + 16 * u + 32 + l, mask)  # quarters 1 and 3
        qh = _u8(blk + 128 + 32 * h + 16 * u + l, mask)  # two high bits for each quarter
        d = _f16(blk + 208, mask)
        sc = blk + 192 + 8 * h + u  # quarter t's int8 scale at sc + 2t
        ks = (g2 // 2) * 128 + (g2 % 2) * 16 + l2
        q0 = ((qa & 15) | ((qh & 3) << 4)).to(tl.float32) - 32.0
        q1 = ((qb & 15) | (((qh >> 2) & 3) << 4)).to(tl.float32) - 32.0
        q2 = ((qa >> 4) | (((qh >> 4) & 3) << 4)).to(tl.float32) - 32.0
        q3 = ((qb >> 4) | (((qh >> 6) & 3) << 4)).to(tl.float32) - 32.0
        acc = _use(acc, d * _i8(sc, mask) * q0, ks, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
        acc = _use(acc, d * _i8(sc + 2, mask) * q1, ks + 32, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
        acc = _use(acc, d * _i8(sc + 4, mask) * q2, ks + 64, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
        acc = _use(acc, d * _i8(sc + 6, mask) * q3, ks + 96, x_ptr, stride_xm, offs_m, m_mask, M, K, MODE, PRECISION)
    return acc


@_jit
def _gguf_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
                 QTYPE: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUPS: tl.constexpr, GROUP_K: tl.constexpr, PIECE: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PDL: tl.constexpr, PRECISION: tl.constexpr):
    pdl_begin(PDL)
    if MODE == 1:
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    else:
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_N, GROUPS, BLOCK_M], tl.float32)
    m_mask = offs_m < M
    n_mask = offs_n < N
    row = w_ptr + offs_n.to(tl.int64)[:, None, None] * row_bytes
    l2 = tl.arange(0, PIECE)[None, :]
    n_groups = K // GROUP_K
    pdl_wait(PDL)
    for g0 in range(0, n_groups, GROUPS):
        g2 = g0 + tl.arange(0, GROUPS)[:, None]
        mask = n_mask[:, None, None] & (g2 < n_groups)[None, :, :]
        acc = _step(acc, row, mask, g2, l2, x_ptr, stride_xm, offs_m, m_mask, M, K, QTYPE, MODE, PRECISION)
    if MODE == 1:
        y = acc
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:  # [BLOCK_N, BLOCK_M]: stored transposed
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None] & m_mask[None, :])


@_jit
def _gguf_dequant_kernel(w_ptr, out_ptr, N, K, row_bytes, stride_om, QTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
                         GROUPS: tl.constexpr, GROUP_K: tl.constexpr, PIECE: tl.constexpr):
    """out [N, K] (the activation dtype) = the weights of the GGUF rows [N, row_bytes]; a program takes BLOCK_N
    rows, GROUPS groups at a time (grid: rows, then K in slices of GROUPS groups)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    row = w_ptr + offs_n.to(tl.int64)[:, None, None] * row_bytes
    n_groups = K // GROUP_K
    g2 = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)[:, None]
    mask = n_mask[:, None, None] & (g2 < n_groups)[None, :, :]
    nothing = tl.zeros([1], tl.float32)
    _step(nothing, row, mask, g2, tl.arange(0, PIECE)[None, :], out_ptr, stride_om, offs_n, n_mask, N, K, QTYPE, 2,
          "ieee")


def gguf_dequantize_into(blocks: torch.Tensor, qtype: int, out: torch.Tensor) -> None:
    """out [N, K] (rows may be strided) = the weights of the GGUF rows blocks [N, row_bytes] of qtype, in out's
    dtype. One kernel; none at N = 0."""
    n, k = out.shape
    assert blocks.is_contiguous() and blocks.shape[0] == n and out.stride(-1) == 1
    if n == 0:
        return
    group_k, piece, _ = GROUPING[qtype]
    groups = max(1, 256 // group_k)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k // group_k, groups))
    _gguf_dequant_kernel[grid](blocks, out, n, k, blocks.shape[1], out.stride(0), QTYPE=qtype,
                               BLOCK_N=DEQUANT_BLOCK_N, GROUPS=groups, GROUP_K=group_k, PIECE=piece, num_warps=4)


def gguf_matmul_dequantized(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                            out: torch.Tensor) -> None:
    """out [M, N] = x @ W^T (+ bias) above GEMV_MAX_ROWS: W's rows decoded a slice at a time into one dense
    scratch of x's dtype (at most DEQUANT_SCRATCH_BYTES), each slice multiplied by torch.mm into its columns
    (out in x's dtype or float32)."""
    m, k = x.shape
    n = blocks.shape[0]
    rows = max(64, DEQUANT_SCRATCH_BYTES // (k * x.element_size()) // 64 * 64)
    scratch = torch.empty(min(rows, n), k, device=x.device, dtype=x.dtype)
    for start in range(0, n, rows):
        w = scratch[:min(rows, n - start)]
        gguf_dequantize_into(blocks[start:start + w.shape[0]], qtype, w)
        cols = out[:, start:start + w.shape[0]]
        if cols.dtype == x.dtype:
            torch.mm(x, w.t(), out=cols)
        else:  # float32 logits (QuantizedLMHead): accumulated in float32, never rounded to x's dtype
            cols.copy_(torch.mm(x, w.t(), out_dtype=cols.dtype) if x.is_cuda else x.float() @ w.t().float())
        if bias is not None:
            cols += bias[start:start + w.shape[0]]


GivenTiles = GGUFTiles | Int8Tiles


def gguf_concat_into(x: torch.Tensor, parts: KernelParts, out: torch.Tensor, pdl: bool = False,
                     qx: QuantizedX | None = None) -> None:
    """out [M, sum of the parts' N] = x @ [W_0; W_1; ...]^T, parts of different types (GGUFConcat), each writing
    its own columns. x is quantized once for the parts that take integer dot products, where more than one does:
    each would otherwise quantize it again, a launch on the one-row step's path (qx: already done). Q4_K rows then
    Q6_K rows at one row of x (Q4_K_M's q|k and v) go in one launch (kernels/gguf_int8_mixed.py)."""
    if qx is None and sum(takes_quantized_x(x, qtype) for _, qtype, _ in parts) > 1:
        qx = quantize_x(x, pdl)
    if [qtype for _, qtype, _ in parts] == [Q4_K, Q6_K] and all(takes_int8_dot(x, q) for q in (Q4_K, Q6_K)) \
            and x.shape[0] == 1:
        (blocks4, _, bias4), (blocks6, _, bias6) = parts
        q4k_then_q6k_into(qx, (blocks4, bias4), (blocks6, bias6), out, pdl)
        return
    start = 0
    for blocks, qtype, bias in parts:
        gguf_linear_into(x, blocks, qtype, bias, out[:, start:start + blocks.shape[0]], pdl, qx=qx)
        start += blocks.shape[0]


def quantization_folds(x: torch.Tensor, qtypes: Sequence[int]) -> bool:
    """Whether the kernel that quantizes x for these types' blocks may take what precedes the projection
    (gguf_norm_linear, gguf_glu_linear): all of them take integer dot products."""
    return all(takes_quantized_x(x, qtype) for qtype in qtypes)


def linear_from_quantized(x: torch.Tensor, qx: QuantizedX, parts: KernelParts, pdl: bool) -> torch.Tensor:
    """x's rows as qx holds them @ [W_0; W_1; ...]^T; of x only its shape and dtype are used."""
    out = torch.empty(x.shape[0], sum(blocks.shape[0] for blocks, _, _ in parts), device=x.device, dtype=x.dtype)
    gguf_concat_into(x, parts, out, pdl, qx)
    return out


def gguf_norm_linear(x: torch.Tensor, norm: tuple[torch.Tensor | None, torch.Tensor, float], parts: KernelParts,
                     pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * weight @ [W_0; W_1; ...]^T, x + residual), norm = (residual or None, weight, eps):
    the norm folded into the activations' quantization (kernels/gguf_int8_input.py), where quantization_folds."""
    qx, residual = norm_quantize_x(x, *norm, pdl=pdl)
    return linear_from_quantized(x, qx, parts, pdl), residual


def gguf_glu_linear(gate_up: torch.Tensor, parts: KernelParts, pdl: bool = False) -> torch.Tensor:
    """(silu(gate) * up) @ [W_0; W_1; ...]^T, gate_up [M, 2K]: the SwiGLU folded into the activations'
    quantization (kernels/gguf_int8_input.py), where quantization_folds for its [M, K] rows."""
    qx = glu_quantize_x(gate_up, pdl)
    return linear_from_quantized(gate_up[:, :gate_up.shape[1] // 2], qx, parts, pdl)


def gguf_linear_into(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                     out: torch.Tensor, pdl: bool = False, tiles: GivenTiles | None = None,
                     qx: QuantizedX | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W the GGUF blocks [N, row_bytes] of qtype; out may be a column
    slice of a wider tensor (its rows strided, its columns contiguous). Half-precision x times Q4_K, Q6_K or
    Q8_0 blocks at the rows kernels/gguf_int8_route.py gives: x quantized to int8, then dp4a dot products or int8
    MMAs (qx: x already quantized for them, where takes_quantized_x), or W decoded to x's dtype in MMAs;
    otherwise up to GEMV_MAX_ROWS rows one kernel, above them dense slices and cuBLAS (gguf_matmul_dequantized);
    nothing at M = 0.
    tiles: the default path's unless given (the benchmark's sweep: Q4kTiles / Q6kTiles / Q8Tiles / MmaTiles
    run the route's kernels at any row count, GGUFTiles this module's, the GEMM mode from 16 rows)."""
    m, k = x.shape
    n = blocks.shape[0]
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.shape == (m, n) and out.stride(-1) == 1
    assert qtype in KERNEL_TYPES, f"no GGUF kernel for ggml type {qtype}"
    if m == 0:
        return
    if block_kernel_into(x, blocks, qtype, bias, out, pdl, tiles, qx):
        return
    if tiles is None and m > GEMV_MAX_ROWS:
        gguf_matmul_dequantized(x, blocks, qtype, bias, out)
        return
    tiles = tiles or choose_tiles(qtype, m, n, k)
    mode = tiles.mode()
    assert mode == GEMM or tiles.block_m >= m, f"GEMV tiles hold {tiles.block_m} rows, not {m}"
    group_k, piece, _ = GROUPING[qtype]
    grid = (triton.cdiv(n, tiles.block_n),) if mode == GEMV else (triton.cdiv(m, tiles.block_m),
                                                                  triton.cdiv(n, tiles.block_n))
    # float32 activations would default to TF32 on the tensor cores (10-bit mantissa): keep fp32 exact, as the
    # GEMV rows and the float32 reference runs need.
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _gguf_kernel[grid](x, blocks, bias if bias is not None else x, out, m, n, k, blocks.shape[1], x.stride(0),
                       out.stride(0), QTYPE=qtype, MODE=mode, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                       GROUPS=tiles.groups, GROUP_K=group_k, PIECE=piece, HAS_BIAS=bias is not None, PDL=pdl,
                       PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                       **launch_options(pdl))
