"""FP8 (E4M3) weights: a projection whose weight is one byte a value, with float32 scales, computed W8A16.

Why: a decode step at a few rows reads every weight once to make a few outputs, so its time is the weight
bytes over HBM bandwidth; one byte a weight instead of two halves the floor. FP8 E4M3 is what Hopper
deployments ship (compressed-tensors' float-quantized checkpoints, block-scaled FP8 releases).

Scales, two layouts, both meaning W[n, k] = fp8[n, k] * scale[...]:
    per row     scale [N]: compressed-tensors' per-channel and per-tensor schemes (a per-tensor scale
                expanded to its rows, so a fused q | k | v keeps each part's own scale), and `--quantization fp8`
    per block   scale [cdiv(N, bn), cdiv(K, bk)]: block-scaled FP8 (`weight_block_size`, `weight_scale_inv`)

Paths (`linear`), chosen by `choose_fp8_path` from shapes only, so fixed before graph capture:
    stream      1-3 rows (1-2 with block scales), bf16: the streaming W8A16 GEMV (kernels/fp8_stream.py), which
                also takes the SwiGLU after the projection (`folds`) and the residual add and RMSNorm after it
                (`linear_then_norm`: o_proj's and down_proj's); the norm before it stays out
    gemv        a few rows otherwise (fp16/fp32 activations, x's rows not word-aligned): the first Triton GEMV
                (kernels/fp8_gemv.py: fp8 weights, 16-bit activations, fp32 accumulation), launched with PDL
                as the bf16 GEMV (kernels/gemv.py)
    split       4-16 rows (3-16 with block scales; up to 64 where N <= 3072), bf16, and where FP8_MEASURED names
                SplitTiles: the split GEMM (kernels/split_gemm.py), W8A16 with the weight on the MMA's wide
                side and K split to fill the GPU in one wave, no activation quantization
    split W8A8  17-64 rows where N > 3072, per-row scales, bf16: the same split GEMM on the activations quantized
                per token by one kernel (kernels/fp8_tokens.py, which also takes the RMSNorm or the SwiGLU
                before the projection: `folds`, `takes_glu_input`), E4M3 times E4M3 on the FP8 tensor cores
    mma         above 16 rows with block scales (64 where N <= 3072), on CUDA: the Triton W8A16 tensor-core kernel
                (kernels/fp8_mma.py)
    scaled_mm   above 64 rows, per-row scales, on CUDA: torch._scaled_mm (the FP8 tensor cores) with the
                activations quantized per token, each row with its own scale, by the same kernel
    dequantize  everything else (CPU, fp32 activations, shapes _scaled_mm refuses): the
                weight dequantized to the activation dtype for this call only, then a dense matmul. It keeps
                no dense copy, so memory stays the FP8 bytes; it is the reference path on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ostinato.kernels.fp8_gemv import Fp8Tiles, fp8_gemv, fp8_scale_shape
from ostinato.kernels.fp8_stream import ResidualNorm, StreamTiles, fp8_stream, fp8_stream_then_norm, stream_takes
from ostinato.kernels.fp8_mma import FP8_DTYPE, FP8_MAX, MMA_TILE, SCALE_FLOOR, MmaTiles, fp8_mma
from ostinato.kernels.fp8_tokens import WHOLE_ROW_MAX_K, glu_quantize_tokens, norm_quantize_tokens, quantize_tokens
from ostinato.kernels.fp8_w8a8 import W8a8Tiles, fp8_w8a8
from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.kernels.split_counters import SplitCounters
from ostinato.kernels.split_gemm import SplitTiles, split_gemm
from ostinato.kernels.triton_optional import triton

__all__ = ["FP8_DTYPE", "FP8_MAX", "Fp8Linear", "Fp8Tiles", "MmaTiles", "SplitTiles", "StreamTiles",
           "choose_fp8_path", "dequantize_fp8", "fp8_gemv", "fp8_mma", "fp8_stream", "fp8_w8a8", "quantize_per_token",
           "quantize_rows", "quantize_tokens", "split_gemm", "SplitW8a8", "W8a8Tiles"]


# The GEMV's accumulator is M_PAD * block_n * block_k fp32 values over 128 threads: 8192 is 64 registers a
# thread, the bf16 GEMV's budget at its widest tile (kernels/gemv.py: M 1, block_n 8, block_k 1024).
_ACC_BUDGET = 8192
# Above 4 rows the GEMV's tiles shrink to a few hundred bytes (the accumulator grows with the rows) and every
# program re-reads all rows of x from L2, more bytes than the weight itself; the tensor cores take them.
FP8_GEMV_MAX_ROWS = 4
# Rows up to which the streaming GEMV takes bf16 activations. Above them the split GEMM, which reads W once for all
# the rows where the GEMV keeps an accumulator a row, made whole steps faster: from 3 rows with block scales (the
# GEMV applies a scale per 128-wide block of each row), from 4 with per-row ones (docs/PERFORMANCE.md, FP8).
_STREAM_ROWS, _STREAM_ROWS_BLOCKS = 3, 2
_SMALL_MMA_ROWS = 16
_FEW_ROWS_SPLIT = SplitTiles(block_k=256)  # per-row scales at 4-16 rows, and narrow projections (choose_fp8_path)
# Block scales: a K step may not cross a 128-wide scale block.
_FEW_ROWS_SPLIT_BLOCKS = SplitTiles(block_k=128)
# Up to this many rows and output columns, _scaled_mm's 128 x 128 tiles cover the projection in at most 24 CTAs on
# 132 SMs: the split GEMM, which splits K to fill the GPU, takes those too.
_NARROW_ROWS, _NARROW_N = 64, 3072
# Up to this many rows, per-row scales, the wider projections: the split GEMM on FP8 activations, not _scaled_mm.
# Whole 8B steps ran 13% faster at 32 rows and 6% at 64, the 1B's 2-3% (docs/PERFORMANCE.md, FP8); above 64
# rows it was not measured.
_W8A8_SPLIT_ROWS = 64


# Rows up to which o_proj's and down_proj's streaming GEMV also computes the norm after them (linear_then_norm:
# its last program adds the residual and normalises the rows, fp8_stream_then_norm), one launch and one PDL hop
# fewer each. 0, off: it has not yet run on a GPU. benchmarks/kernels/fp8_stream_chain.py times it in a step's chain
# of projections; whole steps (benchmarks/step/ab.py, a tree with this at 1 against main) decide it.
NORM_AFTER_ROWS = 0
# That last program holds a whole row in registers, as the norm kernel does, up to this width: at the 8B's one-row
# tile it compiles for sm_90 in the plain kernel's 128 registers up to 8192, in 206 at 16384.
NORM_AFTER_MAX_N = 8192
# Its arrival counter: one for every launch, which on one stream never overlap.
_NORM_COUNTERS = SplitCounters()


@dataclass(frozen=True)
class SplitW8a8:
    """The split GEMM (kernels/split_gemm.py) on the activations quantized per token (quantize_tokens): W8A8, the
    FP8 tensor cores multiply E4M3 by E4M3, nothing widened, K split to fill the GPU where _scaled_mm's 128-wide
    tiles leave SMs idle."""

    tiles: SplitTiles = SplitTiles(block_k=256)


Fp8Path = StreamTiles | Fp8Tiles | MmaTiles | W8a8Tiles | SplitTiles | SplitW8a8 | str
_W8A8_SPLIT = SplitW8a8()
# The SwiGLU folds into the streaming GEMV at every row it takes, as the bf16 fold won at 1-16 (kernels/gemv.py,
# choose_glu_fold); the RMSNorm does not (kernels/fp8_stream.py says why).
_GLU_FOLD_ROWS = 4

# Measured winners at exact (rows, N, K), per-row scales only, overriding the rule below at those shapes: the
# entries benchmarks/kernels/fp8_linear.py prints at the end of its sweep ("table entries") go here.
FP8_MEASURED: dict[tuple[int, int, int], Fp8Path] = {
    # The sweep times each projection alone: without PDL, without the kernels around it in the step, and
    # without the norm and SwiGLU folds qkv and gate_up carry at one row. So its winners go here only once a
    # whole step confirms them; at 5-16 rows the steps chose the rule's split tiles where the sweep chose others.
}


def choose_fp8_path(m: int, n: int, k: int, block_scales: bool, cuda: bool, bf16: bool = True,
                    stream: bool = True) -> Fp8Path:
    """How Fp8Linear computes [m, k] @ W[n, k]^T: the streaming GEMV's or the first GEMV's tiles (StreamTiles,
    Fp8Tiles), the split GEMM's (SplitTiles, or SplitW8a8 on FP8 activations), the tensor-core kernel's (MmaTiles),
    the W8A8 few-rows kernel's (W8a8Tiles), "scaled_mm" or "dequantize". From shapes only, so fixed before graph
    capture.

    - a measured entry of FP8_MEASURED for (m, n, k), per-row scales on CUDA, wins. Only there does the W8A8
      few-rows kernel (kernels/fp8_w8a8.py) run: it rounds the activations to E4M3 at rows the W8A16 kernels
      keep them in 16 bits, so it is taken only where it was measured faster.
    - m <= 3 (2 with block scales: _STREAM_ROWS), bf16, k % 4 == 0, and x's rows readable as words (`stream`,
      fp8_stream.stream_takes): the streaming GEMV (kernels/fp8_stream.py), per-row or block scales, block_n for ~768
      programs as the bf16 rule, at most 4 above two rows (one accumulator a row); block_k 2048 where K allows: at 8 x
      2048 a thread holds all 8 rows of its columns, so x (and the folded norm's work on it) is shared by 8 rows, not 4
      (sm_90 SASS, benchmarks/kernels/fp8_sass.py: 3.7 instructions a byte against 4.1, and 4.8 against 6.4 with the
      norm and SwiGLU folded in).
    - else m <= FP8_GEMV_MAX_ROWS on CUDA, up to the streaming GEMV's rows for bf16: the first W8A16 GEMV
      (kernels/fp8_gemv.py; fp16 activations, or x's rows not words). It reads each weight byte once and needs no
      activation quantization. block_n gives ~768 programs at m = 1 as the bf16 rule does; block_k fills the accumulator
      budget, and two K tiles a step put as many bytes in flight as the bf16 GEMV's tiles do (fp8_gemv.py).
    - bf16 above the streaming GEMV's rows up to 16, and up to 64 where N <= 3072: the W8A16 split GEMM
      (kernels/split_gemm.py), 256-wide K steps (128 with block scales, one block a step): the weight on the MMA's wide
      side, K split so that one wave of about 256 programs covers the projection, no activation quantization. Chosen by
      whole steps, not by the kernel sweep: alone, on Llama-3.1-8B's projections, it is slower than the tensor-core
      kernel at 16 x 32 x 256 tiles and than its own 128-wide K steps, yet whole FP8 steps at 8 rows of the 8B and the
      1B were fastest with it, and the tensor-core kernel made the 8B's slower than bf16's (docs/PERFORMANCE.md, FP8).
      Why the sweep and the step disagree is not yet traced. The narrow projections (the 1B's qkv, o and down) at 32 and
      64 rows made the 1B's step faster than with _scaled_mm, whose 128-wide tiles leave most SMs idle there. Block
      scales take it where per-row scales do: the tensor-core kernel's 128-wide tiles leave the same SMs idle
      (docs/PERFORMANCE.md, FP8, has the block-scaled steps before and after).
    - 17-64 rows, per-row scales, bf16, n and k multiples of 16: the split GEMM on the activations quantized per
      token (SplitW8a8): E4M3 times E4M3, nothing widened, K split so that N = 4096 still fills the GPU, where
      _scaled_mm's 128 x 128 tiles make 32 CTAs. Alone it beat _scaled_mm on each of the 8B's projections at 64
      rows, and whole steps of the 8B and the 1B at 32 and 64 rows (docs/PERFORMANCE.md, FP8).
    - more rows, per-row scales, bf16 activations, n and k multiples of 16 (what _scaled_mm's row-wise
      scaling accepts): _scaled_mm on activations quantized per token by one kernel; the FP8 tensor cores do
      twice bf16's math and read one byte a weight.
    - block scales at more rows: the Triton tensor-core kernel (_scaled_mm's row-wise scaling cannot express
      128 x 128 blocks).
    - else the weight dequantized for the call (CPU, fp32 activations on CUDA)."""
    if not cuda:
        return "dequantize"
    measured = FP8_MEASURED.get((m, n, k)) if not block_scales and bf16 else None
    if measured is not None and (stream or not isinstance(measured, StreamTiles)):
        return measured
    stream_rows = _STREAM_ROWS_BLOCKS if block_scales else _STREAM_ROWS
    if m <= stream_rows and stream and bf16 and k % 4 == 0:
        return _stream_tiles(m, n, k)
    if m <= FP8_GEMV_MAX_ROWS and (m <= stream_rows or not bf16):
        m_pad = triton.next_power_of_2(max(m, 1)) if triton is not None else m
        block_n = 1
        while block_n < 8 and block_n * 2 <= n // 768 and m_pad * block_n * 2 * 1024 <= _ACC_BUDGET:
            block_n *= 2
        block_k = max(128, min(1024, _ACC_BUDGET // (m_pad * block_n)))
        return Fp8Tiles(block_n, block_k, k_tiles=2)
    if bf16 and (m <= _SMALL_MMA_ROWS or (m <= _NARROW_ROWS and n <= _NARROW_N)):
        return _FEW_ROWS_SPLIT_BLOCKS if block_scales else _FEW_ROWS_SPLIT
    if not block_scales and bf16 and n % 16 == 0 and k % 16 == 0:
        return _W8A8_SPLIT if m <= _W8A8_SPLIT_ROWS else "scaled_mm"
    if block_scales and bf16:
        return MMA_TILE
    return "dequantize"


def _folds_into_quantization(path: Fp8Path, k: int) -> bool:
    """Whether the RMSNorm or the SwiGLU before a projection on `path` folds into its activations' quantization
    (kernels/fp8_tokens.py): the split GEMM on FP8 activations, rows of K <= WHOLE_ROW_MAX_K. Whole 8B steps at
    32 and 64 rows were measured with it (docs/PERFORMANCE.md, FP8); the other W8A8 paths keep the kernels apart."""
    return isinstance(path, SplitW8a8) and k <= WHOLE_ROW_MAX_K


def _stream_tiles(m: int, n: int, k: int) -> StreamTiles:
    block_n = 1
    while block_n < 8 and block_n * 2 <= n // 768:
        block_n *= 2
    return StreamTiles(max(2, min(block_n, 4) if m > 2 else block_n), 2048 if k >= 2048 else 1024)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, 1]) with x ~= fp8 * scale row by row: the dynamic
    per-token activation scheme. Torch ops only (no host sync: capturable)."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp_min(SCALE_FLOOR) / FP8_MAX
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
        self.weight_scale = nn.Parameter(torch.empty(fp8_scale_shape(out_features, in_features, self.block),
                                                     dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def _path(self, x: torch.Tensor) -> Fp8Path:
        m, k = x.shape
        cuda = x.is_cuda and triton is not None
        bf16 = x.dtype == torch.bfloat16
        path = choose_fp8_path(m, self.out_features, k, self.block is not None, cuda, bf16)
        if isinstance(path, StreamTiles) and not stream_takes(x, self.weight, self.block):
            # x's rows not word-aligned (a view), or blocks narrower than a word: the first GEMV
            return choose_fp8_path(m, self.out_features, k, self.block is not None, cuda, bf16, stream=False)
        return path

    def folds(self, x: torch.Tensor, norm: bool = False) -> bool:
        path = self._path(x)
        if isinstance(path, StreamTiles):
            return not norm and x.shape[0] <= _GLU_FOLD_ROWS
        return norm and _folds_into_quantization(path, x.shape[1])  # into the activations' quantization

    def takes_glu_input(self, gate_up: torch.Tensor) -> bool:
        return gate_up.shape[1] == 2 * self.in_features and _folds_into_quantization(
            self._path(gate_up[:, :self.in_features]), self.in_features)

    def glu_input_linear(self, gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        xq, x_scale = glu_quantize_tokens(gate_up, pdl)
        return self._w8a8_linear(xq, x_scale, self._path(gate_up[:, :self.in_features]), gate_up.dtype, pdl)

    def fused_linear(self, x: torch.Tensor, pdl: bool = False, glu: bool = False,
                     norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        path = self._path(x)
        if isinstance(path, StreamTiles):
            assert norm is None, "only where folds(x, norm=True), which the streaming GEMV never does"
            return fp8_stream(x, self.weight, self.weight_scale, self.bias, path, pdl, glu, self.block), None
        assert norm is not None and not glu and _folds_into_quantization(path, x.shape[1]), "only where folds(x)"
        xq, x_scale, residual = norm_quantize_tokens(x, *norm, pdl=pdl)
        return self._w8a8_linear(xq, x_scale, path, x.dtype, pdl), residual

    def linear_then_norm(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                         pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
        if x.shape[0] > NORM_AFTER_ROWS or self.out_features > NORM_AFTER_MAX_N:
            return None
        path = self._path(x)
        if not isinstance(path, StreamTiles) or residual.dtype != x.dtype or residual.stride(-1) != 1 \
                or norm_weight.dtype != x.dtype:
            return None
        counter = _NORM_COUNTERS.get(x.device, 1)[:1]
        return fp8_stream_then_norm(x, self.weight, self.weight_scale, self.bias, path,
                                    ResidualNorm(residual, norm_weight, eps, counter), pdl, self.block)

    def linear(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        path = self._path(x)
        if isinstance(path, StreamTiles):
            return fp8_stream(x, self.weight, self.weight_scale, self.bias, path, pdl, block=self.block)
        if isinstance(path, Fp8Tiles):
            return fp8_gemv(x.contiguous(), self.weight, self.weight_scale, self.bias, path, self.block, pdl)
        if isinstance(path, MmaTiles):
            return fp8_mma(x.contiguous(), self.weight, self.weight_scale, self.bias, self.block, path, pdl)
        if isinstance(path, SplitTiles):
            return split_gemm(x.contiguous(), self.weight, self.bias, path, scale=self.weight_scale, pdl=pdl,
                              block=self.block)
        if isinstance(path, SplitW8a8 | W8a8Tiles) or path == "scaled_mm":
            return self._w8a8_linear(*quantize_tokens(x.contiguous(), pdl), path, x.dtype, pdl)
        return F.linear(x, self.dequantize().to(x.dtype), self.bias)

    def _w8a8_linear(self, xq: torch.Tensor, x_scale: torch.Tensor, path: Fp8Path, dtype: torch.dtype,
                     pdl: bool) -> torch.Tensor:
        """The projection of activations quantized per token (xq, x_scale: kernels/fp8_tokens.py) on `path`, a
        W8A8 one, in `dtype`."""
        if isinstance(path, SplitW8a8):
            return split_gemm(xq, self.weight, self.bias, path.tiles, scale=self.weight_scale, out_dtype=dtype,
                              pdl=pdl, x_scale=x_scale)
        if isinstance(path, W8a8Tiles):
            return fp8_w8a8(xq, x_scale, self.weight, self.weight_scale, self.bias, path, dtype, pdl)
        out = torch._scaled_mm(xq, self.weight.t(), scale_a=x_scale, scale_b=self.weight_scale[None, :],
                               out_dtype=dtype)
        return out + self.bias if self.bias is not None else out  # not every cuBLAS row-wise kernel takes one

    def dequantize(self) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.weight_scale, self.block)

    def weight_bytes(self) -> int:
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + self.weight_scale.numel() * 4 + bias

    def extra_repr(self) -> str:
        scales = f"block {self.block[0]}x{self.block[1]}" if self.block is not None else "per row"
        return f"{super().extra_repr()}, fp8 e4m3, scales {scales}"
