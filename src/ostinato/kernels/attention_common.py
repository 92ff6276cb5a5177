"""Pieces shared by the Triton attention kernels (attention/triton_paged.py, kernels/decode_attention.py):
the paged-cache address arithmetic, the FP8 cache's conversions, the tl.dot wrapper for the interpreter, and
host-side checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ostinato.errors import ConfigError


@triton.jit
def paged_kv_offsets(block_tables_ptr, seq_row, toks, tok_mask, kv_head, stride_cache_block,
                     stride_cache_tok, stride_cache_head, BLOCK_SIZE: tl.constexpr):
    """Element offsets (int64: a pool may exceed 2**31 elements) of tokens `toks` of one sequence,
    kv head `kv_head`, in the paged cache. [BLOCK_N]"""
    block = tl.load(block_tables_ptr + seq_row + toks // BLOCK_SIZE, mask=tok_mask, other=0).to(tl.int64)
    return block * stride_cache_block + (toks % BLOCK_SIZE) * stride_cache_tok + kv_head * stride_cache_head


@triton.jit
def kv_to_cache(x, cache_ptr):
    """x as the cache stores it. An FP8 cache takes x through float32, clamped to E4M3's largest finite value
    first, so that a K or V beyond 448 saturates (E4M3 has no infinity: a cast that does not saturate makes it NaN,
    as torch's own conversion does in some versions); the torch backend clamps the same way."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -FP8_KV_MAX), FP8_KV_MAX)
        if EMULATE_FP8_ROUNDING:
            x = _round_to_e4m3(x)
        return x.to(tl.float8e4nv)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def to_loop_type(x, k_cache_ptr, q_ptr):
    """x in the type the K/V loop multiplies in: q's, but fp16 over an FP8 cache where q is 16-bit. E4M3 widens to
    fp16 exactly, a pair an instruction on sm_90; to bf16 Triton goes through fp32 there. In bf16 the FP8 cache's
    loop took twice the instructions of a bf16 cache's for half the bytes, and a 64-row step over it was slower than
    over the bf16 cache (docs/PERFORMANCE.md, FP8 KV cache). The decode and prefill kernels' loops take it."""
    wide = tl.float16 if k_cache_ptr.dtype.element_ty == tl.float8e4nv else q_ptr.dtype.element_ty
    return x.to(q_ptr.dtype.element_ty if q_ptr.dtype.element_ty == tl.float32 else wide)


@triton.jit
def loop_query(q, k_cache_ptr, q_ptr):
    """q (its rows of queries by HEAD_DIM_PAD) in the loop's type (to_loop_type). A bf16 q may lie beyond fp16's
    largest value (65504): there it saturates instead of becoming inf (and the scores NaN)."""
    # Two nested tests, not one `and`: the JIT folds each dtype comparison, but not an `and` of them.
    if k_cache_ptr.dtype.element_ty == tl.float8e4nv:
        if q_ptr.dtype.element_ty == tl.bfloat16:
            q = tl.minimum(tl.maximum(q.to(tl.float32), -FP16_MAX), FP16_MAX)
    return to_loop_type(q, k_cache_ptr, q_ptr)


@triton.jit
def _round_to_e4m3(x):
    """fp32 x (|x| <= 448) rounded to E4M3's grid, to nearest even, still in fp32: the interpreter's own cast rounds
    ties away from zero and flushes subnormals, where a GPU (cvt.rn.satfinite) and torch round to nearest even; on
    the grid already, its cast is exact. Normal values keep 3 of fp32's 23 mantissa bits; below 2^-6 the grid is
    2^-9 apart (subnormals), rounded with the 1.5 * 2^23 trick."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = ((x * 512.0 + 12582912.0) - 12582912.0) / 512.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def dot(a, b, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """tl.dot; UPCAST_DOT multiplies in fp32 instead (exact for 16-bit inputs, fp32 accumulation either
    way). Set only under the interpreter, whose bf16 tl.dot multiplies raw bit patterns (triton 3.9)."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def rowwise_dot(a, b):
    """a [M, K] @ b [K, N] as an elementwise product summed over K, in fp32: for the interpreter only, whose tl.dot
    is numpy's matmul, and OpenBLAS's kernel sums an output row in an order set by the row's place in the tile
    (a GPU's tensor-core dot sums every row alike). Kernels whose rows move within a tile with the batch or the
    chunking take it there (ROWWISE_DOT), so that the CPU tests can check their batch invariance bit for bit."""
    return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


# True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors (tests, CI).
KERNELS_INTERPRETED = type(dot).__name__ == "InterpretedFunction"
EMULATE_FP8_ROUNDING: tl.constexpr = tl.constexpr(KERNELS_INTERPRETED)  # kv_to_cache rounds by hand (interpreter)
LOG2E = 1.4426950408889634
FP8_KV_MAX: tl.constexpr = tl.constexpr(448.0)  # E4M3's largest finite magnitude
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)  # fp16's largest finite magnitude (loop_query)
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# --kv-cache-dtype fp8: the cache holds E4M3; attention computes in the activations' dtype (fp16 in the kernels' loops
# for 16-bit activations: to_loop_type).
FP8_KV_DTYPE = torch.float8_e4m3fn


def check_inputs(x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Host-side attribute checks only (no sync), so they are safe inside a graph capture."""
    if not x.is_cuda and not KERNELS_INTERPRETED:
        raise ConfigError(
            f"the triton attention backend runs on CUDA tensors, got {x.device}; use "
            "--attention-backend torch on CPU (tests may set TRITON_INTERPRET=1 before importing triton)"
        )
    if x.dtype not in _SUPPORTED_DTYPES or k_cache.dtype not in (x.dtype, FP8_KV_DTYPE):
        raise ConfigError(
            f"the triton attention backend supports float32, bfloat16 and float16 with a KV cache of the "
            f"same dtype or FP8 E4M3; got activations {x.dtype} and cache {k_cache.dtype}: pick one of those with "
            "--dtype and --kv-cache-dtype"
        )
    # Internal invariants: the runner allocates both caches identically.
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"


def prefill_shape(q: torch.Tensor, k_cache: torch.Tensor, meta) -> tuple[int, int, int, int, int, int]:
    """(num_tokens, num_heads, head_dim, num_kv_heads, block_size, num_seqs) of a paged prefill launch: q is
    [num_tokens, num_heads, head_dim], the cache [blocks, block_size, kv_heads, head_dim], meta an
    AttentionMetadata whose block table has a row per sequence."""
    num_tokens, num_heads, head_dim = q.shape
    return num_tokens, num_heads, head_dim, k_cache.shape[2], k_cache.shape[1], meta.block_tables.shape[0]


def group_size(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def pad_dim(n: int, minimum: int = 16) -> int:
    """Triton tiles are powers of two and tl.dot needs >= 16 along each dimension."""
    return max(minimum, triton.next_power_of_2(n))


def contiguous_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_settings(dtype: torch.dtype) -> dict:
    """The tl.dot constexprs of the attention kernels."""
    # The interpreter's bf16 tl.dot is wrong (see _dot); multiply in fp32 there.
    upcast = KERNELS_INTERPRETED and dtype == torch.bfloat16
    return {
        # fp32 inputs would default to TF32 on tensor cores (10-bit mantissa); keep fp32 exact.
        "DOT_PRECISION": "ieee" if dtype == torch.float32 or upcast else "tf32",
        "UPCAST_DOT": upcast,
    }
