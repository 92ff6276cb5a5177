"""FP8 (E4M3) weights: a projection whose weight is one byte a value, with float32 scales, computed W8A16.

Why: a decode step at a few rows reads every weight once to make a few outputs, so its time is the weight
bytes over HBM bandwidth; one byte a weight instead of two halves the floor. FP8 E4M3 is what Hopper
deployments ship (compressed-tensors' float-quantized checkpoints, block-scaled FP8 releases).

Scales, two layouts, both meaning W[n, k] = fp8[n, k] * scale[...]:
    per row     scale [N]: compressed-tensors' per-channel and per-tensor schemes (a per-tensor scale
                expanded to its rows, so a fused q | k | v keeps each part's own scale), and `--quantization fp8`
    per block   scale [cdiv(N, bn), cdiv(K, bk)]: block-scaled FP8 (`weight_block_size`, `weight_scale_inv`)

Paths (`linear`), chosen by `choose_fp8_path` from shapes only, so fixed before graph capture:
    gemv        a few rows: the Triton weight-only GEMV below (fp8 weights, 16-bit activations, fp32
                accumulation), launched with PDL as the bf16 GEMV (kernels/gemv.py)
    scaled_mm   more rows, per-row scales, on CUDA: torch._scaled_mm (the FP8 tensor cores) with the
                activations quantized per token, each row with its own scale
    mma         more rows, block scales, on CUDA: a Triton tensor-core kernel, W8A16
    dequantize  everything else (CPU, fp32 activations, shapes _scaled_mm refuses): the
                weight dequantized to the activation dtype for this call only, then a dense matmul. It keeps
                no dense copy, so memory stays the FP8 bytes; it is the reference path on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite E4M3 value (torch.finfo(torch.float8_e4m3fn).max)


@_jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, PDL: tl.constexpr,
):
    """The bf16 GEMV's algorithm (kernels/gemv.py) on one-byte weights: a program owns BLOCK_N outputs for
    all M rows and walks K in BLOCK_K steps into an fp32 [M_PAD, BLOCK_N, BLOCK_K] accumulator summed once
    at the end. Per-row scales multiply the sums once; block scales multiply each weight tile as it loads
    (a gather from the small scale table, which stays in cache). The first weight tile is requested before
    the PDL wait: weights are never written by a step (kernels/pdl.py's contract)."""
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    k_mask = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
    pdl_wait(PDL)
    acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        if k0 > 0:
            w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        wf = w.to(tl.float32)  # [BLOCK_N, BLOCK_K]
        if BLOCK_SCALES:
            s = tl.load(s_ptr + (offs_n // SCALE_BN)[:, None] * stride_sn + (ks // SCALE_BK)[None, :],
                        mask=n_mask[:, None] & k_mask[None, :], other=0.0)
            wf = wf * s
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0).to(tl.float32)  # [M_PAD, BLOCK_K]
        acc += x[:, None, :] * wf[None, :, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    if not BLOCK_SCALES:
        y = y * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@_jit
def _fp8_mma_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, DOT_F32: tl.constexpr,
):
    """W8A16 on the tensor cores, for more rows than the GEMV takes: a [BLOCK_M, BLOCK_N] output tile, each fp8
    weight tile widened to the activation dtype in registers (scaled first with block scales: BLOCK_N and
    BLOCK_K divide the scale block, so one scale covers the tile) and multiplied by tl.dot in fp32."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + ks[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        if BLOCK_SCALES:
            w = w * tl.load(s_ptr + (pid_n * BLOCK_N // SCALE_BN) * stride_sn + k0 // SCALE_BK)
        if DOT_F32:  # the interpreter (CPU tests) multiplies bf16 tiles wrongly: widen both, same values
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), acc)
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


MMA_TILE = (64, 128, 128)  # BLOCK_M, BLOCK_N, BLOCK_K: BLOCK_N and BLOCK_K divide the 128 x 128 scale blocks


def fp8_mma(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            block: tuple[int, int] | None = None, tile: tuple[int, int, int] = MMA_TILE) -> torch.Tensor:
    """fp8_gemv's contract for many rows, on the tensor cores (x bf16 or fp16; with `block`, the tile's
    BLOCK_N and BLOCK_K must divide the scale block)."""
    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk = tile
    assert x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous() and scale.is_contiguous()
    assert block is None or (block[0] % bn == 0 and block[1] % bk == 0)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    sbn, sbk = block if block is not None else (1, 1)
    _fp8_mma_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block is not None else 1, out.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        HAS_BIAS=bias is not None, BLOCK_SCALES=block is not None, SCALE_BN=sbn, SCALE_BK=sbk,
        DOT_F32=type(_fp8_mma_kernel).__name__ == "InterpretedFunction", num_warps=4,
    )
    return out


@dataclass(frozen=True)
class Fp8Tiles:
    """block_n outputs by block_k inputs per K step of the FP8 GEMV."""

    block_n: int
    block_k: int
    num_warps: int = 4


# The accumulator is M_PAD * block_n * block_k fp32 values over 128 threads: 8192 is 64 registers a thread,
# the bf16 GEMV's budget at its widest tile (kernels/gemv.py: M 1, block_n 8, block_k 1024).
_ACC_BUDGET = 8192
FP8_GEMV_MAX_ROWS = 16


def choose_fp8_path(m: int, n: int, k: int, block_scales: bool, cuda: bool, bf16: bool = True) -> Fp8Tiles | str:
    """How Fp8Linear computes [m, k] @ W[n, k]^T: the GEMV's tiles, or "scaled_mm" or "dequantize".

    - m <= FP8_GEMV_MAX_ROWS on CUDA: the W8A16 GEMV. It reads each weight byte once whatever m is, and
      needs no activation quantization (one kernel, no extra rounding of x). block_n gives ~768 programs at
      m = 1 as the bf16 rule does; block_k fills the accumulator budget.
    - more rows, per-row scales, bf16 activations, on CUDA, n and k multiples of 16 (what _scaled_mm's
      row-wise scaling accepts): _scaled_mm,
      compute-bound there, where FP8 tensor cores do twice bf16's math.
    - block scales at more rows, on CUDA: the Triton tensor-core kernel (fp8_mma), which reads one byte a
      weight and widens it in registers (_scaled_mm's row-wise scaling cannot express 128 x 128 blocks).
    - else the weight dequantized for the call (CPU, fp32 activations on CUDA)."""
    if not cuda:
        return "dequantize"
    if m <= FP8_GEMV_MAX_ROWS:
        m_pad = triton.next_power_of_2(max(m, 1)) if triton is not None else m
        block_n = 1
        while block_n < 8 and block_n * 2 <= n // 768 and m_pad * block_n * 2 * 1024 <= _ACC_BUDGET:
            block_n *= 2
        block_k = max(128, min(1024, _ACC_BUDGET // (m_pad * block_n)))
        return Fp8Tiles(block_n, block_k)
    if not block_scales and bf16 and n % 16 == 0 and k % 16 == 0:
        return "scaled_mm"
    if block_scales and bf16:
        return "mma"
    return "dequantize"


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             tiles: Fp8Tiles, block: tuple[int, int] | None = None, pdl: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous) @ (weight [N, K] fp8 * scale)^T (+ bias) -> [M, N] in x's dtype. scale: [N]
    float32 (per row) or, with `block` (bn, bk), [cdiv(N, bn), cdiv(K, bk)] float32. One kernel, grid from
    shapes only: CUDA-graph safe. pdl: launch with programmatic dependent launch (kernels/pdl.py)."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(-1) == 1 and weight.shape == (n, k) and weight.is_contiguous() and scale.is_contiguous()
    assert scale.dtype == torch.float32
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    bn, bk = block if block is not None else (1, 1)
    _fp8_gemv_kernel[(triton.cdiv(n, tiles.block_n),)](
        x, weight, scale, bias if bias is not None else scale, out, m, n, k, x.stride(0), weight.stride(0),
        scale.stride(0) if block is not None else 1, out.stride(0),
        M_PAD=triton.next_power_of_2(m), BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
        BLOCK_SCALES=block is not None, SCALE_BN=bn, SCALE_BK=bk, PDL=pdl, num_warps=tiles.num_warps,
        **launch_options(pdl),
    )
    return out


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, 1]) with x ~= fp8 * scale row by row: the dynamic
    per-token activation scheme. Torch ops only (no host sync: capturable)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense [N, K] weight -> (fp8 [N, K], float32 [N]): per output channel, the row's largest magnitude
    mapped to FP8_MAX (`--quantization fp8`)."""
    q, scale = quantize_per_token(weight)
    return q, scale.reshape(-1)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp8 [N, K] and its scales (per row [N], or per block) -> float32 [N, K]."""
    w = weight.float()
    if block is None:
        return w * scale.float()[:, None]
    n, k = weight.shape
    bn, bk = block
    expanded = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return w * expanded


class Fp8Linear(QuantizedLinear):
    """An [out_features, in_features] projection with FP8 E4M3 weights. Parameters, named as the loader fills
    them: `weight` (fp8 [N, K]), `weight_scale` (float32: [N], or [cdiv(N, bn), cdiv(K, bk)] with `block`),
    `bias` (the activation dtype, or None)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.block = tuple(block) if block is not None else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale_shape = (out_features,) if block is None else \
            (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def linear(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        m, k = x.shape
        cuda = x.is_cuda and triton is not None
        path = choose_fp8_path(m, self.out_features, k, self.block is not None, cuda, x.dtype == torch.bfloat16)
        if isinstance(path, Fp8Tiles):
            return fp8_gemv(x.contiguous(), self.weight, self.weight_scale, self.bias, path, self.block, pdl)
        if path == "mma":
            return fp8_mma(x.contiguous(), self.weight, self.weight_scale, self.bias, self.block)
        if path == "scaled_mm":
            xq, x_scale = quantize_per_token(x)
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale[None, :],
                                   out_dtype=x.dtype)
            return out + self.bias if self.bias is not None else out  # not every cuBLAS row-wise kernel takes one
        return F.linear(x, self.dequantize().to(x.dtype), self.bias)

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, self.block)

    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4 + bias

    def extra_repr(self) -> str:
        scales = f"block {self.block[0]}x{self.block[1]}" if self.block is not None else "per row"
        return f"{super().extra_repr()}, fp8 e4m3, scales {scales}"
