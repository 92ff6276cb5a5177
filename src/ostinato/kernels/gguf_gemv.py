"""Triton kernels that read GGUF blocks (kernels/gguf_linear.py gives the formats) and decode them in registers.

Why: the decode step of a quantized model should read the quantized bytes once, not a bf16 copy of them.

One tile decoder (`_weight_tile`) serves both kernels: for a [BLOCK_N, BLOCK_K] tile of W it computes each
weight's byte address from its (row, column) — block = column // block size, then the type's position of the
weight inside its block — loads the bytes it needs and the block's fp16 scales (two bytes each, bitcast), and
returns the float32 weights. Neighbouring weights share their block's scales and bytes, which come from L1.
    - `_gemv_kernel` (M <= GEMV_MAX_ROWS): as kernels/gemv.py, a program owns BLOCK_N outputs for all rows and
      walks K; fp32 products accumulated elementwise and summed once at the end.
    - `_gemm_kernel` (more rows, prefill): the decoded tile rounded to the activation dtype feeds tl.dot
      (tensor cores), [BLOCK_M, BLOCK_N] outputs per program.
Both launch with PDL when asked (kernels/pdl.py): the first weight tile is decoded before the wait (weights are
never written by the step), activations read after it. Grids come from shapes only: CUDA-graph safe.
"""

from __future__ import annotations

import torch

from ostinato.kernels.gguf_linear import KERNEL_TYPES, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, Q8_0  # noqa: F401
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

GEMV_MAX_ROWS = 8


@_jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@_jit
def _f16_at(ptr, mask):
    """The little-endian fp16 at ptr (a uint8 pointer), as float32."""
    v = (_byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)).to(tl.uint16)
    return v.to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _int8_at(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@_jit
def _scale_min_k4(sc_ptr, s, mask):
    """Sub-block s's six-bit (scale, min) from the 12 packed bytes at sc_ptr (ggml's get_scale_min_k4)."""
    a = _byte(sc_ptr + s, mask)  # q[s]
    b = _byte(sc_ptr + s + 4, mask)  # q[s + 4]
    c = _byte(sc_ptr + tl.where(s >= 4, s - 4, s), mask)  # q[s - 4]
    sc = tl.where(s < 4, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(s < 4, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@_jit
def _weight_tile(w_ptr, rows, ks, mask, row_bytes, QTYPE: tl.constexpr):
    """W[rows, ks] in float32: rows [BLOCK_N, 1] int64, ks [1, BLOCK_K], mask their [BLOCK_N, BLOCK_K] bounds."""
    row = w_ptr + rows * row_bytes
    if QTYPE == 8:  # Q8_0
        base = row + (ks // 32) * 34
        w = _f16_at(base, mask) * _int8_at(base + 2 + ks % 32, mask)
    elif QTYPE == 2 or QTYPE == 3:  # Q4_0, Q4_1
        j = ks % 32
        if QTYPE == 2:
            base = row + (ks // 32) * 18
            q = (_byte(base + 2 + j % 16, mask) >> ((j // 16) * 4)) & 15
            w = _f16_at(base, mask) * (q.to(tl.float32) - 8.0)
        else:
            base = row + (ks // 32) * 20
            q = (_byte(base + 4 + j % 16, mask) >> ((j // 16) * 4)) & 15
            w = _f16_at(base, mask) * q.to(tl.float32) + _f16_at(base + 2, mask)
    elif QTYPE == 12 or QTYPE == 13:  # Q4_K, Q5_K: chunk c of 64, half h of it, l in the half
        j = ks % 256
        c = j // 64
        h = (j % 64) // 32
        l = j % 32
        if QTYPE == 12:
            base = row + (ks // 256) * 144
            q = (_byte(base + 16 + 32 * c + l, mask) >> (4 * h)) & 15
        else:
            base = row + (ks // 256) * 176
            q = (_byte(base + 48 + 32 * c + l, mask) >> (4 * h)) & 15
            q += ((_byte(base + 16 + l, mask) >> (2 * c + h)) & 1) * 16
        sc, mn = _scale_min_k4(base + 4, 2 * c + h, mask)
        w = _f16_at(base, mask) * sc * q.to(tl.float32) - _f16_at(base + 2, mask) * mn
    else:  # Q6_K: half h of 128, quarter t of 32, l in the quarter
        base = row + (ks // 256) * 210
        j = ks % 256
        h = j // 128
        t = (j % 128) // 32
        l = j % 32
        lo = (_byte(base + 64 * h + 32 * (t % 2) + l, mask) >> (4 * (t // 2))) & 15
        hi = (_byte(base + 128 + 32 * h + l, mask) >> (2 * t)) & 3
        q = (lo | (hi << 4)).to(tl.float32) - 32.0
        w = _f16_at(base + 208, mask) * _int8_at(base + 192 + 8 * h + 2 * t + l // 16, mask) * q
    return w


@_jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
                 QTYPE: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PDL: tl.constexpr):
    pdl_begin(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    rows = offs_n.to(tl.int64)[:, None]
    k_mask = offs_k < K
    w = _weight_tile(w_ptr, rows, offs_k[None, :], n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE)
    pdl_wait(PDL)  # the first tile's decode above overlaps the kernel before; activations only after
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                other=0.0).to(tl.float32)
    acc = x[:, None, :] * w[None, :, :]  # [M_PAD, BLOCK_N, BLOCK_K]
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = _weight_tile(w_ptr, rows, ks[None, :], n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    y = tl.sum(acc, axis=2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@_jit
def _gemm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, row_bytes, stride_xm, stride_om,
                 QTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, PDL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pdl_begin(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_n.to(tl.int64)[:, None]
    k_mask = offs_k < K
    w = _weight_tile(w_ptr, rows, offs_k[None, :], n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE)
    pdl_wait(PDL)
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                other=0.0)
    acc = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = _weight_tile(w_ptr, rows, ks[None, :], n_mask[:, None] & k_mask[None, :], row_bytes, QTYPE)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def gguf_linear_into(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                     out: torch.Tensor, pdl: bool = False) -> None:
    """out [M, N] = x [M, K] @ W^T (+ bias), W the GGUF blocks [N, row_bytes] of qtype; out may be a column
    slice of a wider tensor (its rows strided, its columns contiguous). One kernel; none at M = 0."""
    m, k = x.shape
    n = blocks.shape[0]
    assert x.stride(-1) == 1 and blocks.is_contiguous() and out.shape == (m, n) and out.stride(-1) == 1
    assert qtype in KERNEL_TYPES, f"no GGUF kernel for ggml type {qtype}"
    if m == 0:
        return
    common = dict(QTYPE=qtype, HAS_BIAS=bias is not None, PDL=pdl, **launch_options(pdl))
    args = (x, blocks, bias if bias is not None else x, out, m, n, k, blocks.shape[1], x.stride(0), out.stride(0))
    if m <= GEMV_MAX_ROWS:
        block_n = 4 if n >= 4096 else 2
        _gemv_kernel[(triton.cdiv(n, block_n),)](*args, M_PAD=max(triton.next_power_of_2(m), 1), BLOCK_N=block_n,
                                                BLOCK_K=256 if m <= 2 else 128, num_warps=4, **common)
    else:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
        # float32 activations would default to TF32 on the tensor cores (10-bit mantissa): keep fp32 exact, as the
        # GEMV rows and the float32 reference runs need.
        precision = "ieee" if x.dtype == torch.float32 else "tf32"
        _gemm_kernel[grid](*args, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3,
                           DOT_PRECISION=precision, **common)
