"""GGUF weights kept in their llama.cpp blocks: a QuantizedLinear per projection, and the torch dequantizers.

Why: an 8B Q4_K_M file is ~4.9 GB; dequantized to bf16 it is 16 GB, which every decode step would then read.
Holding the blocks as raw bytes on the device and decoding them inside the kernels (kernels/gguf_gemv.py) keeps
a step's reads at what the file holds.

Layout: a projection [N, K] is a uint8 tensor [N, row_bytes]: each row holds the K / block_size blocks of the
type that the file holds for it (ggml quantizes along K, row by row), so rows of one type concatenate (the fused
q|k|v and gate|up projections) and permute (llama.cpp's q/k RoPE order) as plain byte rows. Rows are the file's
bytes as they are, but for Q8_0, whose rows are *planar* (device_rows): the same bytes, each field of every block
gathered into one plane of the row, all codes then all d. Why: its 34-byte blocks leave every other block's codes
only 2-byte aligned, so a kernel reading the file's order makes 16-bit loads; in planes the codes load 16 bytes at
a time. (llama.cpp's SYCL backend reorders Q4_0 blocks the same way, for the same reason.) Q6_K's 210-byte blocks
have the same alignment; on the device each is padded to 224 bytes instead, so that every block starts 16-byte
aligned and the kernels load its words 16 bytes at a time, a block staying one run of its row (the kernel ran
slower on planes: docs/PERFORMANCE.md, GGUF). The padding costs memory (Q6_K tensors take 7% more), hardly any
bandwidth: HBM moves 32-byte sectors, and a 210-byte block spans 7 or 8 of them wherever it starts, the padded
block exactly 7.

The block formats (ggml-common.h; little-endian fp16 scales):
    Q8_0  32 weights, 34 B: d, int8 q[32]                                  w = d * q
    Q4_0  32 weights, 18 B: d, q[16] (weight j: low nibble of byte j % 16 for j < 16, high nibble above)
                                                                          w = d * (q - 8)
    Q4_1  32 weights, 20 B: d, m, q[16] (nibbles as Q4_0)                  w = d * q + m
    Q4_K  256 weights, 144 B: d, dmin, 12 B of 6-bit (scale, min) for 8 sub-blocks of 32, q[128]: the 64
          weights of chunk c take the low nibbles of bytes 32c..32c+31 (sub-block 2c), then the high ones
                                                                          w = d * sc * q - dmin * mn
    Q5_K  256 weights, 176 B: as Q4_K with qh[32] before q[128]; bit 2c (+1 for the high half) of qh[l] is
          weight l's fifth bit in chunk c
    Q6_K  256 weights, 210 B: ql[128], qh[64], int8 scales[16], d: two halves of 128, each four quarters of
          32 (low 4 bits from ql, 2 high bits from qh)                     w = d * sc * (q - 32)
Types without a kernel are dequantized at load (model/gguf_weights.py) and never reach this module.

The torch dequantizers below are the CPU path (run per call, on the device the blocks are on) and the reference
the kernels are tested against, itself tested against the `gguf` library's numpy dequantizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.kernels.triton_optional import triton

if TYPE_CHECKING:
    from ostinato.kernels.gguf_int8_dot import QuantizedX  # which imports this module's type ids

# A projection's parts as the kernels take them (kernels/gguf_gemv.py): (blocks, qtype, bias) each, in output order,
# blocks as device_rows gives them.
KernelParts = list[tuple[torch.Tensor, int, torch.Tensor | None]]

# ggml type ids (gguf.GGMLQuantizationType) -> (name, weights per block, bytes per block), for the typed kernels.
Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 8, 12, 13, 14
KERNEL_TYPES = {
    Q8_0: ("Q8_0", 32, 34), Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20),
    Q4_K: ("Q4_K", 256, 144), Q5_K: ("Q5_K", 256, 176), Q6_K: ("Q6_K", 256, 210),
}


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights of type qtype."""
    _, block, nbytes = KERNEL_TYPES[qtype]
    if k % block:
        raise ValueError(f"a {KERNEL_TYPES[qtype][0]} row holds a multiple of {block} weights, got {k}")
    return k // block * nbytes


# The planar types: each block's fields as (first byte, end) in the block, in the order their planes take in a row.
PLANE_FIELDS = {Q8_0: ((2, 34), (0, 2))}
# The padded types: a block's bytes on the device, zeros after the file's.
PADDED_BLOCK_BYTES = {Q6_K: 224}  # the kernels hold literal 224 (Triton reads no globals)


def device_row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of k weights of type qtype as the kernels hold it (device_rows)."""
    _, _, nbytes = KERNEL_TYPES[qtype]
    return row_bytes(qtype, k) // nbytes * PADDED_BLOCK_BYTES.get(qtype, nbytes)


def device_rows(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    """The file's rows [N, row_bytes] uint8 -> the kernels' rows: planar for PLANE_FIELDS' types, each block padded
    for PADDED_BLOCK_BYTES' (the module's docstring), the same tensor for the others."""
    n, nbytes = blocks.shape[0], KERNEL_TYPES[qtype][2]
    b = blocks.reshape(n, -1, nbytes)
    if qtype in PADDED_BLOCK_BYTES:
        padded = b.new_zeros(n, b.shape[1], PADDED_BLOCK_BYTES[qtype])
        padded[:, :, :nbytes] = b
        return padded.reshape(n, -1)
    if qtype not in PLANE_FIELDS:
        return blocks
    return torch.cat([b[:, :, start:end].reshape(n, -1) for start, end in PLANE_FIELDS[qtype]], dim=1)


def file_rows(rows: torch.Tensor, qtype: int) -> torch.Tensor:
    """device_rows undone: the kernels' rows -> the file's block order."""
    n, nbytes = rows.shape[0], KERNEL_TYPES[qtype][2]
    if qtype in PADDED_BLOCK_BYTES:
        return rows.reshape(n, -1, PADDED_BLOCK_BYTES[qtype])[:, :, :nbytes].reshape(n, -1)
    if qtype not in PLANE_FIELDS:
        return rows
    blocks = rows.shape[1] // nbytes
    fields = PLANE_FIELDS[qtype]
    planes = torch.split(rows, [blocks * (end - start) for start, end in fields], dim=1)
    by_start = sorted(zip(fields, planes), key=lambda field_plane: field_plane[0][0])  # the block's own order
    return torch.cat([p.reshape(n, blocks, end - start) for (start, end), p in by_start], dim=2).reshape(n, -1)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The little-endian fp16 at byte `at` of every block, b [..., block_bytes] uint8 -> [...] float32."""
    return b[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] 4-bit values: all low nibbles, then all high ones (ggml's order)."""
    q = qs.to(torch.int32)
    return torch.cat((q & 15, q >> 4), dim=-1).float()


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit (scale, min) pairs packed in the 12 bytes of a Q4_K / Q5_K block: [..., 12] -> 2 x [..., 8]."""
    q = scales.to(torch.int32)
    lo_sc, lo_m = q[..., 0:4] & 63, q[..., 4:8] & 63
    hi_sc = (q[..., 8:12] & 15) | ((q[..., 0:4] >> 6) << 4)
    hi_m = (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)
    return torch.cat((lo_sc, hi_sc), -1).float(), torch.cat((lo_m, hi_m), -1).float()


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: q [..., 256] in chunk order -> weights, with the block's d, dmin and sub-block scales."""
    sc, mn = _scale_min_k4(b[..., 4:16])
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    q = q.view(*q.shape[:-1], 8, 32)
    return (d * sc)[..., None] * q - (dmin * mn)[..., None]


def _dequant_q4_k(b: torch.Tensor) -> torch.Tensor:
    qs = b[..., 16:144].reshape(*b.shape[:-1], 4, 32)
    return _k_quant(b, _nibbles(qs).flatten(-2))


def _dequant_q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 16:48].to(torch.int32)  # [..., 32]
    qs = b[..., 48:176].reshape(*b.shape[:-1], 4, 32)
    low = _nibbles(qs)  # [..., 4 chunks, 64]
    bits = torch.arange(8, device=b.device, dtype=torch.int32).view(4, 2, 1)  # chunk c, half h -> bit 2c + h
    high = ((qh[..., None, None, :] >> bits) & 1).flatten(-2).float()  # [..., 4, 64]
    return _k_quant(b, (low + 16 * high).flatten(-2))


def _dequant_q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[..., 0:128].to(torch.int32).reshape(*b.shape[:-1], 2, 2, 32)  # half, which 32 bytes, l
    qh = b[..., 128:192].to(torch.int32).reshape(*b.shape[:-1], 2, 1, 32)
    sc = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*b.shape[:-1], 2, 4, 2)  # half, quarter, l//16
    d = _f16(b, 208)[..., None, None, None]
    low = torch.cat((ql & 15, ql >> 4), dim=-2)  # [..., 2, 4 quarters, 32]: quarter t's low bits
    shifts = 2 * torch.arange(4, device=b.device, dtype=torch.int32).view(4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).float() - 32  # [..., 2, 4, 32]
    q = q.view(*q.shape[:-1], 2, 16) * (d * sc)[..., None]
    return q.flatten(-4)


def _dequant_32(b: torch.Tensor, qtype: int) -> torch.Tensor:
    d = _f16(b, 0)[..., None]
    if qtype == Q8_0:
        return d * b[..., 2:34].contiguous().view(torch.int8).float()
    if qtype == Q4_0:
        return d * (_nibbles(b[..., 2:18]) - 8)
    return d * _nibbles(b[..., 4:20]) + _f16(b, 2)[..., None]  # Q4_1


def dequantize_blocks(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """blocks [N, row_bytes] uint8 of type qtype in the file's order (file_rows) -> the weight [N, k] float32,
    with torch ops on its device."""
    _, block, nbytes = KERNEL_TYPES[qtype]
    b = blocks.reshape(blocks.shape[0], k // block, nbytes)
    if block == 32:
        w = _dequant_32(b, qtype)
    else:
        w = {Q4_K: _dequant_q4_k, Q5_K: _dequant_q5_k, Q6_K: _dequant_q6_k}[qtype](b)
    return w.reshape(blocks.shape[0], k)


class GGUFProjection(QuantizedLinear):
    """What GGUFLinear and GGUFConcat share: the norm before them, or the SwiGLU before a down projection, folded
    into the quantization of their input (kernels/gguf_int8_input.py), where every part takes integer dot products
    at these rows."""

    def kernel_parts(self) -> KernelParts:
        """(blocks, qtype, bias) of each part, in output order."""
        raise NotImplementedError

    def _quantization_folds(self, x: torch.Tensor) -> bool:
        """Whether the kernel that quantizes this projection's input x [M, in_features] may do more."""
        if not x.is_cuda or triton is None:
            return False
        from ostinato.kernels.gguf_gemv import quantization_folds

        return quantization_folds(x, [qtype for _, qtype, _ in self.kernel_parts()])

    def folds(self, x: torch.Tensor, norm: bool = False) -> bool:
        return norm and self._quantization_folds(x)  # the activation after gate_up stays its own kernel

    def fused_linear(self, x: torch.Tensor, pdl: bool = False, glu: bool = False,
                     norm: tuple[torch.Tensor | None, torch.Tensor, float] | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert norm is not None and not glu, "a GGUF projection folds the norm before it only (folds)"
        from ostinato.kernels.gguf_gemv import gguf_norm_linear

        return gguf_norm_linear(x, norm, self.kernel_parts(), pdl)

    def int8_input(self, x: torch.Tensor) -> QuantizedX | None:
        if not self._quantization_folds(x):
            return None
        from ostinato.kernels.gguf_int8_dot import empty_quantized

        return empty_quantized(x.shape[0], x.shape[1], x.device)

    def int8_input_linear(self, qx: QuantizedX, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        from ostinato.kernels.gguf_gemv import linear_from_quantized

        return linear_from_quantized(x, qx, self.kernel_parts(), pdl)

    def takes_glu_input(self, gate_up: torch.Tensor) -> bool:
        return gate_up.dim() == 2 and gate_up.shape[1] == 2 * self.in_features \
            and self._quantization_folds(gate_up[:, :self.in_features])

    def glu_input_linear(self, gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        from ostinato.kernels.gguf_gemv import gguf_glu_linear

        return gguf_glu_linear(gate_up, self.kernel_parts(), pdl)


class GGUFLinear(GGUFProjection):
    """One projection of one GGUF type, from the file's rows blocks [N, row_bytes] uint8, held as the kernels'
    rows (device_rows) in the buffer `blocks`; bias in the activation dtype."""

    def __init__(self, qtype: int, blocks: torch.Tensor, in_features: int, bias: torch.Tensor | None = None):
        super().__init__()
        if qtype not in KERNEL_TYPES:
            raise ValueError(f"no GGUF kernel for ggml type {qtype}")
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != row_bytes(qtype, in_features):
            raise ValueError(f"{KERNEL_TYPES[qtype][0]} blocks for {in_features} inputs are [N, "
                             f"{row_bytes(qtype, in_features)}] uint8, got {tuple(blocks.shape)} {blocks.dtype}")
        self.qtype = qtype
        self.in_features, self.out_features = in_features, blocks.shape[0]
        self.register_buffer("blocks", device_rows(blocks, qtype).contiguous())
        self.bias = bias
        self.host_weight: torch.Tensor | None = None  # the torch path's dequantized weight (see linear_into)

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.qtype][0]

    def kernel_parts(self) -> KernelParts:
        return [(self.blocks, self.qtype, self.bias)]

    def linear(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, device=x.device, dtype=x.dtype)
        self.linear_into(x, out, pdl)
        return out

    def linear_into(self, x: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> None:
        """out [M, N] (any row stride, columns contiguous) = x @ W^T (+ b): GGUFConcat's parts write slices."""
        if x.is_cuda and triton is not None:
            from ostinato.kernels.gguf_gemv import gguf_linear_into

            gguf_linear_into(x, self.blocks, self.qtype, self.bias, out, pdl)
            return
        # Off CUDA, the weight is dequantized on the first call and kept. Why: the host path is the reference and
        # the tests' path, compute-bound, and unpacking every block again each step took seconds per step of the
        # 135M model on a small CPU; kept, it runs as fast as the dequantized folder does.
        if self.host_weight is None or self.host_weight.dtype != x.dtype:
            self.host_weight = self.dequantize().to(x.dtype)
        w = self.host_weight
        if out.dtype != x.dtype:  # float32 logits from 16-bit rows (QuantizedLMHead): CPU has no mixed-dtype mm
            out.copy_(x.float() @ w.float().T)
        elif out.is_contiguous():
            torch.matmul(x, w.T, out=out)
        else:
            out.copy_(x @ w.T)
        if self.bias is not None:
            out += self.bias

    def dequantize(self) -> torch.Tensor:
        return dequantize_blocks(file_rows(self.blocks, self.qtype), self.qtype, self.in_features)

    def weight_bytes(self) -> int:
        return self.blocks.numel() + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def extra_repr(self) -> str:
        return f"{self.type_name}, {super().extra_repr()}"


class GGUFConcat(GGUFProjection):
    """A fused projection (q|k|v, gate|up) whose shards have different GGUF types (Q4_K_M mixes them per
    tensor): each shard keeps its own kernel and writes its columns of the one output, so no copy is made."""

    def __init__(self, parts: list[GGUFLinear]):
        super().__init__()
        self.parts = torch.nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None  # each part adds its own

    def linear(self, x: torch.Tensor, pdl: bool = False) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.out_features, device=x.device, dtype=x.dtype)
        if x.is_cuda and triton is not None:
            from ostinato.kernels.gguf_gemv import gguf_concat_into

            gguf_concat_into(x, self.kernel_parts(), out, pdl)
            return out
        start = 0
        for part in self.parts:
            part.linear_into(x, out[:, start:start + part.out_features], pdl)
            start += part.out_features
        return out

    def kernel_parts(self) -> KernelParts:
        return [(p.blocks, p.qtype, p.bias) for p in self.parts]

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def weight_bytes(self) -> int:
        return sum(p.weight_bytes() for p in self.parts)
