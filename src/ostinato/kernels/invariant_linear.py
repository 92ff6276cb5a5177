"""Batch-invariant projections: y = x @ W^T (+ b) whose every row is computed the same way for every row count.

Why: cuBLAS picks its kernel (tile shape, split-K, reduction order) by M, and the GEMV / few-rows kernels of
kernels/gemv.py and kernels/skinny.py are chosen by M too (choose_gemv_tiles, choose_skinny_tiles; the few-rows
kernel also pads M to a power of two, which changes its tl.dot tile). So a request's hidden states change in the
last bit with the number of rows beside it, and in bf16 a greedy tie flips. Under --batch-invariant every
projection and the lm_head run through `invariant_linear` instead.

Triton (CUDA): the split GEMM of kernels/split_gemm.py (its docstring gives the algorithm) at one constant tiling,
INVARIANT_TILES, for every row count. Its K steps, their order and the split of K come from N, K and the tiles
alone, so an output element's sums run over the same K steps in the same order in every launch, and a row's
result depends on its own values only (the MMA's columns are independent; padded rows are masked loads of 0 and
never stored). Which of its two launches runs (splits in parallel, or one after another) is chosen by M and does
not change the bits. Only the row tile follows M (16 to 128 columns: the next power of two), and only a width of
the same MMA, whose column sums the GPU test and benchmarks/kernels/invariant_linear.py check bit for bit at 1 to
1100 rows. PDL and the first weight tile loaded before the PDL wait change the timing, not the arithmetic. The
cost: a parallel launch writes and reads its fp32 partials (splits x M x N, L2-sized), and no norm or activation
folds into a projection.

CPU (and a CUDA install without triton): torch's F.linear is not batch invariant in fp32 either (oneDNN and MKL
pick kernels by M), so `rowwise_linear` runs F.linear one row at a time: every row is then the same [1, K] call.
Slow, and meant for the CPU tests and the CPU oracle, not for speed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ostinato.errors import ConfigError
from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.kernels.split_gemm import SplitTiles, split_gemm


# The one tiling of every batch-invariant launch. Changing block_n, block_k or the split fields changes the
# reduction order, so it is a constant, never chosen per call. Measured (docs/PERFORMANCE.md, the batch-invariant
# tile sweep): block_k 128 and 3 stages; row tiles up to 128 read each weight tile half as often in prefill.
INVARIANT_TILES = SplitTiles(block_n=64, block_k=128, num_warps=4, num_stages=3, split_programs=256,
                             min_split_k_tiles=4, min_row_tile=16, max_row_tile=128, prefetch_max_rows=16)


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, tiles: SplitTiles = INVARIANT_TILES,
                   pdl: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous), weight [N, K] contiguous, bias [N] or None -> [M, N] in out_dtype (default x's),
    accumulated in fp32, each row by the same arithmetic for every M (split_gemm at the constant tiles)."""
    return split_gemm(x, weight, bias, tiles, out_dtype=out_dtype, pdl=pdl)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear one row at a time, [M, K] -> [M, N]: every row the same [1, K] call, whatever M (the torch
    path's invariant linear; see the module docstring)."""
    if x.shape[0] == 0:
        return F.linear(x, weight, bias)
    return torch.cat([F.linear(x[i:i + 1], weight, bias) for i in range(x.shape[0])])


def _check_layer(layer: torch.nn.Module) -> None:
    tp = getattr(layer, "tp", None)
    if isinstance(layer, QuantizedLinear):
        raise ConfigError("--batch-invariant supports unquantized checkpoints only: a quantized projection picks "
                          "its kernel by row count; drop --batch-invariant or load a bf16/fp16/fp32 checkpoint")
    if tp is not None and tp.world_size > 1:
        raise ConfigError("--batch-invariant needs --tensor-parallel-size 1")


def gemm_linear(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False) -> torch.Tensor:
    """layer(x) through invariant_gemm (the batch-invariant Triton kernel set's linear)."""
    _check_layer(layer)
    return invariant_gemm(x if x.stride(-1) == 1 else x.contiguous(), layer.weight, layer.bias, pdl=pdl)


def rowwise_layer_linear(x: torch.Tensor, layer: torch.nn.Linear) -> torch.Tensor:
    """layer(x) through rowwise_linear (the batch-invariant torch kernel set's linear)."""
    _check_layer(layer)
    return rowwise_linear(x, layer.weight, layer.bias)


def gemm_logits(hidden: torch.Tensor, weight: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """hidden [M, K] @ weight^T -> fp32 logits [M, V] through invariant_gemm: 16-bit operands, fp32 accumulation
    and output, never rounded to 16 bits (model/decoder.py's compute_logits says why)."""
    return invariant_gemm(hidden if hidden.stride(-1) == 1 else hidden.contiguous(), weight, out_dtype=torch.float32,
                          pdl=pdl)


def rowwise_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """gemm_logits on the torch path: fp32 rows one at a time (16-bit values are exact in fp32)."""
    return rowwise_linear(hidden.float(), weight.float())
