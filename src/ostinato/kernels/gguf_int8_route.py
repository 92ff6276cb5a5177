"""Which tensor-core or integer kernel multiplies half-precision activations by Q4_K, Q6_K or Q8_0 blocks, by the
rows of x: the dp4a kernels (kernels/gguf_int8_dot.py, gguf_int8_q6k_q80.py) at gguf_int8_dot.INT8_DOT_ROWS, the
int8 MMA kernels (kernels/gguf_int8_mma.py) at gguf_int8_mma.INT8_MMA_ROWS (first where both would), the
half-precision MMA kernels (the same module, W decoded to x's dtype) at HALF_MMA_ROWS; given tiles, whatever their
rows. The int8 kernels read x quantized to int8 per 32 values (quantize_x), which the quantizing kernels of
kernels/gguf_int8_input.py may fold into what comes before the projection; gguf_gemv.gguf_linear_into asks here
first.
"""

from __future__ import annotations

import torch

from ostinato.kernels.gguf_int8_dot import INT8_DOT_ROWS, QuantizedX, int8_dot_applies
from ostinato.kernels.gguf_int8_q4k import Q4kTiles, q4k_rows_into
from ostinato.kernels.gguf_int8_mma import (HALF_MMA, INT8_MMA_ROWS, MmaTiles, half_mma_applies, int8_mma_applies,
                                            mma_rows_into)
from ostinato.kernels.gguf_int8_q6k_q80 import Q6kTiles, Q8Tiles, q6k_rows_into, q80_rows_into
from ostinato.kernels.gguf_linear import Q4_K, Q6_K, Q8_0

Int8Tiles = Q4kTiles | Q6kTiles | Q8Tiles | MmaTiles
# The dp4a kernels by ggml type, each with its tiles: the default path at the rows INT8_DOT_ROWS gives, and
# wherever the benchmark gives their tiles.
INT8_DOT_KERNELS = {Q4_K: (Q4kTiles, q4k_rows_into), Q6_K: (Q6kTiles, q6k_rows_into), Q8_0: (Q8Tiles, q80_rows_into)}


def takes_int8_mma(x: torch.Tensor, qtype: int, tiles: object | None = None) -> bool:
    """Whether x times qtype's blocks is made by the int8 MMA kernels."""
    if tiles is not None:
        return isinstance(tiles, MmaTiles) and not tiles.decode_to_x and qtype in INT8_DOT_KERNELS
    return int8_mma_applies(x, qtype)


def takes_half_mma(x: torch.Tensor, qtype: int, tiles: object | None = None) -> bool:
    """Whether x times qtype's blocks is made by the MMA kernels decoding W to x's dtype."""
    if tiles is not None:
        return isinstance(tiles, MmaTiles) and tiles.decode_to_x and qtype in INT8_DOT_KERNELS
    return half_mma_applies(x, qtype)


def takes_int8_dot(x: torch.Tensor, qtype: int, tiles: object | None = None) -> bool:
    """Whether x times qtype's blocks is made by the dp4a kernels: where the MMA kernels do not take it."""
    int8_tiles, _ = INT8_DOT_KERNELS.get(qtype, (None, None))
    if tiles is not None:
        return int8_tiles is not None and isinstance(tiles, int8_tiles)
    return int8_dot_applies(x, qtype) and not int8_mma_applies(x, qtype)


def takes_quantized_x(x: torch.Tensor, qtype: int, tiles: object | None = None) -> bool:
    """Whether x times qtype's blocks is made from x quantized to int8 (quantize_x), by either kernel."""
    return takes_int8_mma(x, qtype, tiles) or takes_int8_dot(x, qtype, tiles)


def int8_rows(qtype: int) -> tuple[int, int] | None:
    """(first, last): the row counts at which qtype's projections take x quantized to int8 by default, the two
    kernels' ranges together (they meet); None for types that never do."""
    ranges = [r for r in (INT8_DOT_ROWS.get(qtype), INT8_MMA_ROWS.get(qtype)) if r is not None]
    return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else None


def block_kernel_into(x: torch.Tensor, blocks: torch.Tensor, qtype: int, bias: torch.Tensor | None,
                      out: torch.Tensor, pdl: bool = False, tiles: object | None = None,
                      qx: QuantizedX | None = None) -> bool:
    """out = x @ W^T (+ bias) by the kernel here that takes it (qx: x already quantized, for the int8 ones);
    False, and nothing done, where none does."""
    if takes_half_mma(x, qtype, tiles):
        mma_rows_into(x, blocks, qtype, bias, out, pdl, tiles or HALF_MMA)
        return True
    if takes_int8_mma(x, qtype, tiles):
        mma_rows_into(x, blocks, qtype, bias, out, pdl, tiles, qx)
        return True
    if takes_int8_dot(x, qtype, tiles):
        INT8_DOT_KERNELS[qtype][1](x, blocks, bias, out, pdl, tiles, qx)
        return True
    return False
