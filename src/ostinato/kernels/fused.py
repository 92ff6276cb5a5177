"""Fused Triton kernels for the non-GEMM steps of a decoder layer, each with its plain-torch reference.

Why: a decode step is one CUDA-graph replay, yet inside a graph every kernel still costs ~2 us, and at
small models the step is mostly kernel count (Qwen3-0.6B shape: 2.0 ms per step against a 0.3 ms
weight-read floor). These kernels fold the elementwise work around the GEMMs into one launch each:

    rms_norm / fused_add_rms_norm   r = residual + x; y = rmsnorm(r) * weight; -> (y, r) (2 kernels -> 1)
    silu_and_mul                    silu(gate) * up from the fused gate|up projection   (2 -> 1)
    qk_norm_rope                    optional per-head q/k RMSNorm (Qwen3), then RoPE on q and k, reading
                                    cos/sin straight from the table by position         (3-7 -> 1)
    qk_norm_rope_write_kv           the same, and k and v written to their paged-cache slots (+ KV write);
                                    at decode the Triton attention backend does all of it inside its
                                    attention kernel instead (kernels/decode_attention.py, decode_with_rope)

At decode batches the small-batch GEMV (kernels/gemv.py) takes the norm before a projection (qkv, gate_up) into
its own kernel where that pays (DecoderKernels.norm_linear): one launch fewer for each, the same values but for
the norm's reduction order. (The activation folded into down_proj was measured too, and lost: each program
recomputed silu over its whole K, which cost more than the launch it saved.)

`DecoderKernels` bundles one implementation of each step; the decoder picks `TRITON_KERNELS` for CUDA
tensors when triton is importable and `TORCH_KERNELS` otherwise (`kernels_for`), once, when the KV
caches are bound. The torch functions (`*_ref`) are the CPU path and the test oracle.

Rounding (bf16/fp16): every kernel computes in fp32 and rounds to the model dtype exactly where the torch
path stores an intermediate in that dtype, so results agree to the last bit except where fp32 reduction
order or exp/rsqrt approximations move a value across a rounding boundary (1 ulp, rarely). One
deliberate difference: the norm kernel follows HF's LlamaRMSNorm (normalise in fp32, round to the dtype,
then multiply by the weight and round again), while torch's fused `F.rms_norm` (the reference) multiplies
by the weight before its single rounding; the two differ by at most 1 ulp of the dtype, and not at all
in fp32.

CUDA graphs: launch grids depend on tensor shapes only, nothing reads a tensor value on the host, and
outputs are allocated by shape. Triton compiles a kernel on its first call, so run a step eagerly before
capturing (the graph runner's warm-up does). positions must lie in [0, cos_sin_cache.shape[0]); the
scheduler guarantees it and the kernel does not check (that would need a host sync).

Under TRITON_INTERPRET=1 (CPU tests) the interpreter truncates fp32 -> bf16 instead of rounding to nearest
even, so the kernels round bf16 by hand there (EMULATE_BF16), making CPU results match the GPU's.
"""

from __future__ import annotations

import functools
from dataclasses import fields

import torch

from ostinato.errors import ConfigError
from ostinato.kernels import deferred_launch
from ostinato.kernels.decoder_kernels import DecoderKernels
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.gemv import (folds_glu, small_batch_glu_linear, small_batch_linear, small_batch_linear_norm,
                                   small_batch_norm_linear, small_batch_int8_input, small_batch_int8_input_linear)
from ostinato.kernels.invariant_linear import gemm_linear, gemm_logits, rowwise_layer_linear, rowwise_logits
from ostinato.kernels.fused_ref import (  # noqa: F401  (re-exported with the kernels they check)
    fused_add_rms_norm_ref, linear_ref, qk_norm_rope_ref, rms_norm_ref, silu_and_mul_ref,
)

from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

if triton is not None:  # the torch path needs none of these
    from ostinato.kernels.attention_common import kv_to_cache
    from ostinato.kernels.rope_tile import norm_rope, rope_partner, rope_table
    from ostinato.kernels.rounding import rms_norm_row
    from ostinato.kernels.linear_epilogue import residual_sum, silu_mul


# ---- Triton kernels --------------------------------------------------------------------------------------

@_jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, eps,
    N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr,
    PDL: tl.constexpr,
):
    # One program per row. A whole row (hidden <= 16384) sits in registers, so x is read once.
    pdl_begin(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: may precede the wait
    pdl_wait(PDL)
    # x (+ the residual, the sum rounded to the model dtype: the next residual), [BLOCK_N]
    h = residual_sum(x_ptr + row * stride_x, residual_ptr + row * stride_r, offs, mask, HAS_RESIDUAL, EMULATE_BF16)
    if HAS_RESIDUAL:
        tl.store(residual_out_ptr + row * stride_ro + offs, h.to(residual_out_ptr.dtype.element_ty), mask=mask)
    # HF's order: normalise in fp32, round to the model dtype, multiply by the weight, round again.
    y = rms_norm_row(h, w, N, eps, out_ptr, EMULATE_BF16)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, stride_in, stride_out,
    I: tl.constexpr, BLOCK: tl.constexpr, EMULATE_BF16: tl.constexpr, PDL: tl.constexpr,
):
    # Grid (tokens, column blocks); the gate of column c is at c, its up at I + c.
    pdl_begin(PDL)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + I + cols, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul(gate, up, out_ptr, EMULATE_BF16)  # torch rounds silu(gate) before the multiply; so do we
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _qk_norm_rope_kernel(
    heads_ptr, q_weight_ptr, k_weight_ptr, cos_sin_ptr, positions_ptr, out_ptr,
    k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_ht, stride_hh, stride_ot, stride_oh, stride_cs,
    stride_cache_block, stride_cache_tok, stride_cache_head, eps,
    NUM_HEADS: tl.constexpr, NUM_QK_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_H: tl.constexpr, QK_NORM: tl.constexpr, EMULATE_BF16: tl.constexpr,
    WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr,
):
    # Grid (tokens, head blocks): BLOCK_H heads (q heads first, then k heads, then with WRITE_KV the v
    # heads) of one token per program. Without WRITE_KV, q and k go to out [T, H + Hkv, D]; with it, q
    # goes to out [T, H, D] and k (rotated) and v (as read) go straight to their slot of the paged cache.
    pdl_begin(PDL)
    pdl_wait(PDL)
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    d = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    partner = rope_partner(d, HEAD_DIM)
    num_read = NUM_QK_HEADS + NUM_KV_HEADS if WRITE_KV else NUM_QK_HEADS
    mask = (head[:, None] < num_read) & (d[None, :] < HEAD_DIM)
    row = heads_ptr + token * stride_ht + head[:, None] * stride_hh
    x = tl.load(row + d[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_H, HEAD_DIM_PAD]
    v = x  # the v heads' rows, stored as read (WRITE_KV)
    # The partner elements are read a second time rather than permuted in registers: same cache lines.
    x_partner = tl.load(row + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    w, w_partner = x, x  # unread without QK_NORM
    if QK_NORM:
        is_q = (head < NUM_HEADS)[:, None]
        d_mask = d < HEAD_DIM
        w = tl.where(is_q, tl.load(q_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                     tl.load(k_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :])
        w_partner = tl.where(is_q, tl.load(q_weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :],
                             tl.load(k_weight_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :])
    cos, signed_sin = rope_table(cos_sin_ptr, tl.load(positions_ptr + token), stride_cs, d, HEAD_DIM)
    out = norm_rope(x, x_partner, w, w_partner, cos, signed_sin, eps, out_ptr, HEAD_DIM, QK_NORM, EMULATE_BF16)
    if WRITE_KV:
        is_q = (head < NUM_HEADS)[:, None]
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask & is_q)
        # A negative slot marks a token with nowhere to go (as _write_kv_kernel); padded decode rows carry
        # a slot in the scratch block instead and are written there like any other.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        if slot >= 0:
            cache_row = (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_tok
            is_k = ((head >= NUM_HEADS) & (head < NUM_QK_HEADS))[:, None]
            is_v = (head >= NUM_QK_HEADS)[:, None]
            k_dst = k_cache_ptr + cache_row + (head - NUM_HEADS)[:, None] * stride_cache_head + d[None, :]
            v_dst = v_cache_ptr + cache_row + (head - NUM_QK_HEADS)[:, None] * stride_cache_head + d[None, :]
            tl.store(k_dst, kv_to_cache(out, k_cache_ptr), mask=mask & is_k)
            tl.store(v_dst, kv_to_cache(v, v_cache_ptr), mask=mask & is_v)
    else:
        tl.store(out_ptr + token * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


# ---- launchers -------------------------------------------------------------------------------------------

_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_NORM_WIDTH = 32768  # one row per program in registers (Llama/Qwen hidden sizes are <= 16384)
_SILU_BLOCK = 1024  # columns per silu_and_mul program
_ROPE_ELEMENTS = 1024  # head elements per qk_norm_rope program (BLOCK_H * HEAD_DIM_PAD)


# True when triton was imported with TRITON_INTERPRET=1: kernels then run on CPU tensors (tests, CI).
_KERNELS_INTERPRETED = type(_rms_norm_kernel).__name__ == "InterpretedFunction"


def _interpreted() -> bool:
    return _KERNELS_INTERPRETED


def _checked_flags(x: torch.Tensor, what: str) -> dict:
    """Checks the activation tensor's attributes on the host (no sync: safe inside a capture) and returns
    the constexprs every kernel takes."""
    if triton is None:
        raise ConfigError("the fused decoder kernels need triton; install it (pip install ostinato[triton])")
    if not x.is_cuda and not _interpreted():
        raise ConfigError(f"the fused Triton kernels run on CUDA tensors, got {what} on {x.device}; the "
                          "decoder uses the torch kernels there (tests may set TRITON_INTERPRET=1)")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise ConfigError(f"the fused kernels support float32, bfloat16 and float16, got {what} in {x.dtype}; "
                          "pick one of those with --dtype")
    assert x.stride(-1) == 1, f"{what}: the last dimension must be contiguous"
    return {"EMULATE_BF16": _interpreted() and x.dtype == torch.bfloat16}


def _norm_warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, pdl: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    flags = _checked_flags(x, "x")
    num_tokens, n = x.shape  # [T, N]
    assert weight.shape == (n,) and weight.dtype == x.dtype and weight.is_contiguous()
    assert n <= _MAX_NORM_WIDTH, f"rms_norm over {n} > {_MAX_NORM_WIDTH} features is not supported"
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    residual_out = None
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1
        residual_out = torch.empty_like(out)
    if num_tokens == 0:
        return out, residual_out
    r, r_out = (residual, residual_out) if residual is not None else (x, out)  # unread placeholders
    block = triton.next_power_of_2(n)
    deferred_launch.launch(_rms_norm_kernel, (num_tokens,), (
        x, r, weight, out, r_out,
        x.stride(0), r.stride(0), out.stride(0), r_out.stride(0), eps,
    ), dict(
        N=n, BLOCK_N=block, HAS_RESIDUAL=residual is not None, num_warps=_norm_warps(block), PDL=pdl, **flags,
        **launch_options(pdl),
    ), (out,) if residual_out is None else (out, residual_out))
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = False) -> torch.Tensor:
    """x [T, N] -> rmsnorm(x) * weight [T, N] in one kernel (HF's rounding order; see module doc).
    pdl (here and below): launch with programmatic dependent launch (kernels/pdl.py)."""
    return _launch_rms_norm(x, None, weight, eps, pdl)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual [T, N] -> (rmsnorm(residual + x) * weight, residual + x) in one kernel.

    The sum is rounded to the model dtype (it is the next residual, as in HF) and normalised in fp32.
    Both outputs are new tensors; the inputs are not modified.
    """
    normed, new_residual = _launch_rms_norm(x, residual, weight, eps, pdl)
    return normed, new_residual


def silu_and_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """gate_up [T, 2I] (gate | up, the fused projection's output) -> silu(gate) * up [T, I], one kernel."""
    flags = _checked_flags(gate_up, "gate_up")
    num_tokens, two_i = gate_up.shape
    assert two_i % 2 == 0, "gate_up must hold gate and up halves of equal width"
    inter = two_i // 2
    out = torch.empty(num_tokens, inter, device=gate_up.device, dtype=gate_up.dtype)  # [T, I]
    if num_tokens == 0:
        return out
    block = min(_SILU_BLOCK, triton.next_power_of_2(inter))
    deferred_launch.launch(_silu_and_mul_kernel, (num_tokens, triton.cdiv(inter, block)), (
        gate_up, out, gate_up.stride(0), out.stride(0),
    ), dict(I=inter, BLOCK=block, num_warps=4, PDL=pdl, **flags, **launch_options(pdl)), (out,))
    return out


def qk_norm_rope(heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos_sin_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                 eps: float, pdl: bool = False) -> torch.Tensor:
    """`qk_norm_rope_ref` in one kernel: heads [T, H + 2Hkv, D] -> new contiguous [T, H + Hkv, D].

    With q_weight and k_weight ([D] each, Qwen3) each q and k head is RMS-normalised first; without
    them only RoPE is applied. The v heads are not touched (the caller keeps heads[:, H + Hkv:] as a view).
    """
    return _launch_qk_norm_rope(heads, q_weight, k_weight, cos_sin_cache, positions, num_heads, num_kv_heads,
                                eps, None, pdl)


def qk_norm_rope_write_kv(heads: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                          cos_sin_cache: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int,
                          eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """`qk_norm_rope` and the attention backend's `write_kv` in one kernel: returns q, a new contiguous
    [T, H, D], and writes token t's rotated k and its v (heads[:, H + Hkv:], unchanged) to slot
    slot_mapping[t] of k_cache / v_cache ([num_blocks, block_size, Hkv, D], attention/base.py's layout);
    negative slots are skipped. Saves one launch per layer and the k round trip through memory."""
    return _launch_qk_norm_rope(heads, q_weight, k_weight, cos_sin_cache, positions, num_heads, num_kv_heads,
                                eps, (k_cache, v_cache, slot_mapping), pdl)


def _launch_qk_norm_rope(heads, q_weight, k_weight, cos_sin_cache, positions, num_heads, num_kv_heads, eps,
                         kv_write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                         pdl: bool) -> torch.Tensor:
    flags = _checked_flags(heads, "heads")
    num_tokens, total_heads, head_dim = heads.shape
    qk_heads = num_heads + num_kv_heads
    assert total_heads >= qk_heads and head_dim % 2 == 0
    assert cos_sin_cache.shape[-1] == 2 * head_dim and cos_sin_cache.stride(-1) == 1
    assert cos_sin_cache.dtype == heads.dtype and positions.shape == (num_tokens,)
    qk_norm = q_weight is not None
    assert qk_norm == (k_weight is not None), "pass both q and k norm weights or neither"
    if qk_norm:
        assert q_weight.shape == k_weight.shape == (head_dim,)
        assert q_weight.is_contiguous() and k_weight.is_contiguous()
    if kv_write is not None:
        k_cache, v_cache, slot_mapping = kv_write
        assert total_heads == qk_heads + num_kv_heads, "the v heads must follow the k heads"
        assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
        assert k_cache.dim() == 4 and k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.stride(-1) == 1
        assert k_cache.dtype in (heads.dtype, torch.float8_e4m3fn) and slot_mapping.shape == (num_tokens,)
        out_heads, grid_heads = num_heads, total_heads
    else:
        k_cache = v_cache = slot_mapping = heads  # unread placeholders
        out_heads, grid_heads = qk_heads, qk_heads
    out = torch.empty(num_tokens, out_heads, head_dim, device=heads.device, dtype=heads.dtype)
    if num_tokens == 0:
        return out
    head_dim_pad = triton.next_power_of_2(head_dim)
    # The tile height comes from the q|k heads in both forms (the v heads of the K/V-writing form take more
    # programs, not taller tiles): Triton lays a [BLOCK_H, HEAD_DIM_PAD] tile out by its shape, and the layout
    # sets the order in which a row's sum of squares adds up. With BLOCK_H 16 against 8 (4 q and 4 kv heads,
    # head_dim 32: sm_90 sums 4 values a thread over 8 lanes, against 2 over 16) fp32 q and k differed from
    # qk_norm_rope's in the last bit; with one tile both forms round alike, to the bit.
    block_h = min(triton.next_power_of_2(qk_heads), max(1, _ROPE_ELEMENTS // head_dim_pad))
    weights = (q_weight, k_weight) if qk_norm else (heads, heads)  # unread placeholders without qk-norm
    deferred_launch.launch(_qk_norm_rope_kernel, (num_tokens, triton.cdiv(grid_heads, block_h)), (
        heads, *weights, cos_sin_cache, positions, out, k_cache, v_cache, slot_mapping,
        heads.stride(0), heads.stride(1), out.stride(0), out.stride(1), cos_sin_cache.stride(0),
        *(k_cache.stride()[:3] if kv_write is not None else (0, 0, 0)), eps,
    ), dict(
        NUM_HEADS=num_heads, NUM_QK_HEADS=qk_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h, QK_NORM=qk_norm, WRITE_KV=kv_write is not None,
        BLOCK_SIZE=k_cache.shape[1] if kv_write is not None else 1, num_warps=4, PDL=pdl, **flags,
        **launch_options(pdl),
    ), (out,))
    return out


# ---- choosing an implementation --------------------------------------------------------------------------

TORCH_KERNELS = DecoderKernels("torch", rms_norm_ref, fused_add_rms_norm_ref, silu_and_mul_ref,
                               qk_norm_rope_ref, linear_ref)
# Projections: the Triton small-batch linear at the decode shapes where it beats cuBLAS (kernels/gemv.py).
TRITON_KERNELS = DecoderKernels("triton", rms_norm, fused_add_rms_norm, silu_and_mul, qk_norm_rope,
                                small_batch_linear, qk_norm_rope_write_kv=qk_norm_rope_write_kv,
                                norm_linear=small_batch_norm_linear, folds_glu=folds_glu,
                                glu_linear=small_batch_glu_linear, int8_input=small_batch_int8_input,
                                int8_input_linear=small_batch_int8_input_linear, linear_norm=small_batch_linear_norm)


# The same kernels launched with programmatic dependent launch (kernels/pdl.py): each may start while the one before it
# finishes. Only for devices pdl.resolve_pdl accepts (sm_90+).
TRITON_KERNELS_PDL = DecoderKernels("triton+pdl", **{
    f.name: functools.partial(getattr(TRITON_KERNELS, f.name), pdl=True)
    for f in fields(DecoderKernels) if f.name != "name" and getattr(TRITON_KERNELS, f.name) is not None})


# --batch-invariant: every projection and the lm_head through one kernel whose per-row arithmetic is the same for
# every row count (kernels/invariant_linear.py); no norm or activation folded into a projection (the folds are
# chosen by row count). The norms, the activation and q/k-norm + RoPE are already one program per row.
INVARIANT_TORCH_KERNELS = DecoderKernels("torch+invariant", rms_norm_ref, fused_add_rms_norm_ref, silu_and_mul_ref,
                                         qk_norm_rope_ref, rowwise_layer_linear, logits=rowwise_logits)
INVARIANT_TRITON_KERNELS = DecoderKernels("triton+invariant", rms_norm, fused_add_rms_norm, silu_and_mul,
                                          qk_norm_rope, gemm_linear, qk_norm_rope_write_kv=qk_norm_rope_write_kv,
                                          logits=gemm_logits)
# With PDL (kernels/pdl.py): the same kernels and arithmetic, only each may start while the one before it finishes;
# every read of an activation still comes after the wait for its producer, so no value changes.
INVARIANT_TRITON_KERNELS_PDL = DecoderKernels("triton+invariant+pdl", **{
    f.name: functools.partial(getattr(INVARIANT_TRITON_KERNELS, f.name), pdl=True)
    for f in fields(DecoderKernels) if f.name != "name" and getattr(INVARIANT_TRITON_KERNELS, f.name) is not None})


def kernels_for(device: torch.device, pdl: bool = False, batch_invariant: bool = False) -> DecoderKernels:
    """Triton on CUDA when triton is importable (with PDL when `pdl`); torch otherwise (CPU, where torch is the
    reference). batch_invariant: the invariant set of that kind."""
    if device.type == "cuda" and triton is not None:
        if batch_invariant:
            return INVARIANT_TRITON_KERNELS_PDL if pdl else INVARIANT_TRITON_KERNELS
        return TRITON_KERNELS_PDL if pdl else TRITON_KERNELS
    return INVARIANT_TORCH_KERNELS if batch_invariant else TORCH_KERNELS
