"""`ostinato make-checkpoint --format gguf`: random-weight GGUF files at the public shapes (tools/checkpoint.py).

Written with the `gguf` library's writer, tensor by tensor (memory stays at one tensor), under llama.cpp's names
and with its q/k row order. Types the library can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16, F16) are drawn
as float32 and quantized with its own functions. It has no quantizer for the k-quants (Q4_K, Q5_K, Q6_K, ...):
their blocks are drawn directly (`random_blocks`), random sub-block codes under scales that give weights of the
shape's init_std, which is what a random checkpoint needs and what the kernels read.
"""

from __future__ import annotations

import numpy as np

# Byte offsets of each type's fp16 scales inside its block (gguf_linear's table of formats).
_F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# |code| * sub-block scale of a typical weight, per unit of d (so that d = std / this gives weights of ~std).
_CODE_SCALE = {"Q8_0": 64.0, "Q4_0": 4.0, "Q4_1": 8.0, "Q4_K": 8.0 * 32, "Q5_K": 16.0 * 32, "Q6_K": 16.0 * 64}


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """rows x k random weights of a GGUF type as raw blocks [rows, row_bytes] uint8: every code byte uniform,
    the fp16 scales (d, and dmin or m) drawn around std / _CODE_SCALE so the weights have about that spread."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if k % block:
        raise ValueError(f"a {type_name} row holds a multiple of {block} weights, got {k}")
    b = rng.integers(0, 256, size=(rows, k // block, nbytes), dtype=np.uint8)
    if type_name == "Q6_K":  # int8 sub-block scales: keep them positive and moderate
        b[..., 192:208] = rng.integers(1, 64, size=(rows, k // block, 16), dtype=np.uint8)
    for at in _F16_FIELDS[type_name]:
        scale = std / _CODE_SCALE[type_name]
        d = rng.uniform(0.5 * scale, 1.5 * scale, size=b.shape[:-1]).astype(np.float16)
        b[..., at:at + 2] = d[..., None].view(np.uint8)
    return b.reshape(rows, -1)
