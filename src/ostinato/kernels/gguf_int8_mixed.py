"""One launch for a fused projection whose shards are Q4_K rows then Q6_K rows, at one row of x: Q4_K_M's q|k and v.

Why: llama.cpp's Q4_K_M keeps half the layers' v projections in Q6_K, so those layers' q|k|v is two shards of two
types (model/gguf_weights.py merges shards of one type). Launched apart, the v shard is its own kernel of a few
megabytes, mostly latency: on the 8B shape at one row, 16 of them took 4.8-6.6 us each at about a quarter of HBM
bandwidth (docs/PERFORMANCE.md, GGUF). Here the first programs of the launch take the Q4_K rows and the rest the
Q6_K rows, each as its own one-row kernel does (gguf_int8_q4k.q4k_one_row, gguf_int8_q6k_q80.q6k_rows, the same
tiles), from the one quantized x: the same values, one launch.
"""

from __future__ import annotations

import torch

from ostinato.kernels.gguf_int8_dot import SUPER_BLOCK, QuantizedX
from ostinato.kernels.gguf_int8_q4k import Q4kTiles, q4k_one_row
from ostinato.kernels.gguf_int8_q6k_q80 import Q6K_ONE_ROW, q6k_rows
from ostinato.kernels.gguf_linear import Q4_K, Q6_K, device_row_bytes
from ostinato.kernels.pdl import launch_options
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

_Q4K_TILES = Q4kTiles()


@_jit
def _q4k_then_q6k_kernel(xq_ptr, dx_ptr, sx_ptr, cx_ptr, s16_ptr, w4_ptr, bias4_ptr, out4_ptr, N4, n_words,
                         row_words4, w6_ptr, b6_ptr, bias6_ptr, out6_ptr, N6, n_pos, row_words6, q4k_programs,
                         BLOCK_N4: tl.constexpr, BLOCK_J4: tl.constexpr, EVEN4: tl.constexpr,
                         HAS_BIAS4: tl.constexpr, BLOCK_N6: tl.constexpr, BLOCK_J6: tl.constexpr,
                         EVEN6: tl.constexpr, HAS_BIAS6: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr):
    """Programs below q4k_programs: out4 [1, N4] from the Q4_K rows; the rest: out6 [1, N6] from the Q6_K rows."""
    program = tl.program_id(0)
    if program < q4k_programs:
        q4k_one_row(program, xq_ptr, dx_ptr, sx_ptr, cx_ptr, w4_ptr, bias4_ptr, out4_ptr, N4, n_words, row_words4,
                    BLOCK_N4, BLOCK_J4, EVEN4, HAS_BIAS4, PDL, ASM)
    else:
        q6k_rows(program - q4k_programs, xq_ptr, dx_ptr, s16_ptr, w6_ptr, b6_ptr, bias6_ptr, out6_ptr, N6, n_pos,
                 row_words6, 0, 1, BLOCK_N6, BLOCK_J6, EVEN6, HAS_BIAS6, PDL, ASM)


def q4k_then_q6k_into(qx: QuantizedX, q4k: tuple[torch.Tensor, torch.Tensor | None],
                      q6k: tuple[torch.Tensor, torch.Tensor | None], out: torch.Tensor, pdl: bool = False) -> None:
    """out [1, N4 + N6] = x @ [W4; W6]^T (+ each shard's bias), x one row as qx holds it; W4 the Q4_K blocks [N4,
    144 K / 256], W6 the Q6_K blocks padded to 224 bytes [N6, 224 K / 256] (q4k, q6k: (blocks, bias or None))."""
    from ostinato.kernels.attention_common import KERNELS_INTERPRETED

    (blocks4, bias4), (blocks6, bias6) = q4k, q6k
    n4, n6, k = blocks4.shape[0], blocks6.shape[0], qx.xq.shape[1] * 4
    assert qx.xq.shape[0] == 1 and out.shape == (1, n4 + n6) and out.stride(-1) == 1
    assert k % SUPER_BLOCK == 0 and blocks4.is_contiguous() and blocks6.is_contiguous()
    assert blocks4.shape[1] == device_row_bytes(Q4_K, k) and blocks6.shape[1] == device_row_bytes(Q6_K, k)
    assert _Q4K_TILES.num_warps == Q6K_ONE_ROW.num_warps, "one launch, one warp count"
    words4, words6 = blocks4.view(torch.int32), blocks6.view(torch.int32)
    q4k_programs = triton.cdiv(n4, _Q4K_TILES.block_n)
    grid = (q4k_programs + triton.cdiv(n6, Q6K_ONE_ROW.block_n),)
    _q4k_then_q6k_kernel[grid](
        qx.xq, qx.dx, qx.sx, qx.cx, qx.s16, words4, bias4 if bias4 is not None else qx.dx, out, n4, k // 8,
        words4.shape[1], words6, blocks6, bias6 if bias6 is not None else qx.dx, out[:, n4:], n6, k // 16,
        words6.shape[1], q4k_programs, BLOCK_N4=_Q4K_TILES.block_n, BLOCK_J4=_Q4K_TILES.block_j,
        EVEN4=k // 8 % _Q4K_TILES.block_j == 0, HAS_BIAS4=bias4 is not None, BLOCK_N6=Q6K_ONE_ROW.block_n,
        BLOCK_J6=Q6K_ONE_ROW.block_j, EVEN6=k // 16 % Q6K_ONE_ROW.block_j == 0, HAS_BIAS6=bias6 is not None,
        PDL=pdl, ASM=not KERNELS_INTERPRETED, num_warps=_Q4K_TILES.num_warps, **launch_options(pdl))
