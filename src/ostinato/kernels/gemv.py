"""A bandwidth-bound Triton linear for decode batches of a few rows: y = x @ W^T (+ b), W [N, K] row-major.

Why: at M <= 4 a decode projection reads its whole weight to make a few outputs, so its time should be
the weight bytes over HBM bandwidth. cuBLAS at the small projections of the small models is far from
that (the Qwen3-0.6B o_proj, 4 MB, takes over ten times its floor at M = 1), and every projection pays a
few microseconds however small (docs/PERFORMANCE.md, "Why these defaults").

Algorithm: grid (cdiv(N, BLOCK_N),); a program owns BLOCK_N output features for all M rows and walks K in
BLOCK_K chunks: a [BLOCK_N, BLOCK_K] weight tile (K contiguous: coalesced 16-byte loads) times the
[M_PAD, BLOCK_K] activations, multiplied elementwise into an fp32 [M_PAD, BLOCK_N, BLOCK_K] accumulator
that is summed over K once, at the end (no cross-thread reduction inside the loop). No split over K, so
no reduce kernel and no atomics: small BLOCK_N gives enough programs instead (N / BLOCK_N >= a few per SM).
Exactly one kernel per call, grid from shapes only: CUDA-graph safe.

The norm folded in (gemv_norm_linear): the decoder's RMSNorm (with the residual add) before qkv_proj and
gate_up_proj runs inside this kernel instead of as its own launch: each program computes the rows' 1/rms from
the whole row, then normalises each K tile as it loads it; program 0 writes the residual sum.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ostinato.kernels.quantized_linear import QuantizedLinear
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)
from ostinato.kernels import deferred_launch, skinny

if triton is not None:  # the torch path needs none of these
    from ostinato.kernels.rounding import rms_normed, round_like
    from ostinato.kernels.linear_epilogue import glu_rows, store_glu


# What the kernel multiplies by W (X_MODE): x itself, or rmsnorm(x [+ residual]) * norm_weight, the norm before
# the projection folded in (the residual sum, when given, written out by program 0 as the next residual).
X_PLAIN, X_NORM = 0, 1


@_jit
def row_rstd(x_ptr, res_ptr, res_out_ptr, stride_xm, stride_rm, stride_rom, offs_m, m_mask, K, eps, write,
             K_PAD: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """1 / rms of each of the M rows of x (+ residual, the sum rounded to the model dtype; `write`: store that
    sum to res_out): the whole row at once, as the RMSNorm kernel (kernels/fused.py) reads it. [M_PAD] fp32."""
    offs = tl.arange(0, K_PAD)
    mk = m_mask[:, None] & (offs < K)[None, :]
    h = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs[None, :], mask=mk, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs[None, :], mask=mk, other=0.0).to(tl.float32)
        h = round_like(h + r, x_ptr, EMULATE_BF16)
        if write:
            tl.store(res_out_ptr + offs_m[:, None] * stride_rom + offs[None, :],
                     h.to(res_out_ptr.dtype.element_ty), mask=mk)
    return tl.math.rsqrt(tl.sum(h * h, axis=1) / K + eps)


@_jit
def _x_tile(x_ptr, res_ptr, stride_xm, stride_rm, offs_m, m_mask, ks, k_mask, rstd, nw,
            X_MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Columns ks of what multiplies W, [M_PAD, BLOCK_K] fp32, rounded to the model dtype wherever the unfused
    kernels store it (fused.py's rounding order), so the fold changes no value but by reduction order."""
    mk = m_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + ks[None, :], mask=mk, other=0.0).to(tl.float32)
    if X_MODE == 1:  # X_NORM: HF's order, normalise in fp32, round, multiply by the weight, round
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + offs_m[:, None] * stride_rm + ks[None, :], mask=mk, other=0.0).to(tl.float32)
            x = round_like(x + r, x_ptr, EMULATE_BF16)
        x = rms_normed(x, rstd[:, None], nw[None, :], x_ptr, EMULATE_BF16)
    return x


@_jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, res_out_ptr,
    M, N, K, stride_xm, stride_wn, stride_om, stride_rm, stride_rom, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PEEL_FIRST: tl.constexpr, PDL: tl.constexpr, X_MODE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    K_PAD: tl.constexpr, EMULATE_BF16: tl.constexpr, GLU: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    offs_n, w_index = glu_rows(pid, N, BLOCK_N, GLU)  # each row's output; its row of W
    offs_m = tl.arange(0, M_PAD)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    nw = tl.zeros([BLOCK_K], tl.float32)  # the norm's weight (X_NORM), loaded per K step
    if PEEL_FIRST:
        # The first K step out of the loop, its weight tile requested before the wait for the previous kernel
        # (kernels/pdl.py): weights are never written by the step, so with PDL their read overlaps that kernel.
        k_mask = offs_k < K
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if X_MODE == 1:
            nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    rstd = tl.zeros([M_PAD], tl.float32)
    if X_MODE == 1:
        rstd = row_rstd(x_ptr, res_ptr, res_out_ptr, stride_xm, stride_rm, stride_rom, offs_m, m_mask, K, eps,
                        pid == 0, K_PAD, HAS_RESIDUAL, EMULATE_BF16)
    if PEEL_FIRST:
        x = _x_tile(x_ptr, res_ptr, stride_xm, stride_rm, offs_m, m_mask, offs_k, k_mask, rstd, nw, X_MODE,
                    HAS_RESIDUAL, EMULATE_BF16)
        acc = x[:, None, :] * w.to(tl.float32)[None, :, :]  # [M_PAD, BLOCK_N, BLOCK_K]
        k_start = BLOCK_K
    else:
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], tl.float32)
        k_start = 0
    for k0 in range(k_start, K, BLOCK_K):
        ks = k0 + offs_k
        k_mask = ks < K
        w = tl.load(w_rows + ks[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_N, BLOCK_K]
        if X_MODE == 1:
            nw = tl.load(nw_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        x = _x_tile(x_ptr, res_ptr, stride_xm, stride_rm, offs_m, m_mask, ks, k_mask, rstd, nw, X_MODE,
                    HAS_RESIDUAL, EMULATE_BF16)  # [M_PAD, BLOCK_K]
        acc += x[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(b_ptr + w_index, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if GLU:
        cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        store_glu(out_ptr, y, offs_m, cols, m_mask[:, None] & (cols < N)[None, :], stride_om, M_PAD, BLOCK_N,
                  EMULATE_BF16)
    else:
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GemvTiles:
    """block_n outputs by block_k inputs per step. peel_first: the first K step runs before the loop, its
    weight tile loaded before the PDL wait (faster at K <= 3072; slower at K >= 4096 with block_n 4, the 8B's
    o_proj and down_proj; docs/PERFORMANCE.md, "Why these defaults")."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    peel_first: bool = False


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tiles: GemvTiles,
                out_dtype: torch.dtype | None = None, pdl: bool = False, glu: bool = False) -> torch.Tensor:
    """x [M, K] (K contiguous), weight [N, K] contiguous, bias [N] or None -> [M, N] in out_dtype (default
    x's dtype), accumulated in fp32. Meant for M <= 8; the accumulator is M_PAD * block_n * block_k fp32.
    pdl: launch with programmatic dependent launch (kernels/pdl.py; the caller checked the device supports it).
    glu: W is a (gate | up) projection [2I, K]: the output is silu(gate) * up [M, I], the SwiGLU activation
    folded into the epilogue (no [M, 2I] tensor, no activation kernel); block_n then counts weight rows."""
    m, k = x.shape
    assert x.stride(-1) == 1
    return _launch(x, k, weight, bias, tiles, out_dtype or x.dtype, pdl, glu=glu)


def gemv_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                     weight: torch.Tensor, bias: torch.Tensor | None, tiles: GemvTiles,
                     pdl: bool = False, glu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual) * norm_weight) @ W^T (+ b), and x + residual, in one kernel: the decoder's
    fused_add_rms_norm (or rms_norm, residual None; the residual returned is then x itself) and the projection
    after it. x, residual [M, K] (K contiguous, K <= NORM_FOLD_MAX_K), norm_weight [K] -> ([M, N], [M, K]).
    Every program normalises the rows itself (they are a few KB, read from L2); program 0 also stores the sum.
    glu: as gemv_linear's, the output then [M, N / 2]."""
    m, k = x.shape
    assert x.stride(-1) == 1 and norm_weight.shape == (k,) and norm_weight.is_contiguous()
    assert k <= NORM_FOLD_MAX_K, f"the norm fold holds a whole row in registers: K {k} > {NORM_FOLD_MAX_K}"
    residual_out = x
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        residual_out = torch.empty(m, k, device=x.device, dtype=x.dtype)
    out = _launch(x, k, weight, bias, tiles, x.dtype, pdl, X_NORM, residual, norm_weight, residual_out, eps, glu)
    return out, residual_out


def _launch(x, k, weight, bias, tiles, out_dtype, pdl, x_mode=X_PLAIN, residual=None, norm_weight=None,
            residual_out=None, eps=0.0, glu=False) -> torch.Tensor:
    m = x.shape[0]
    n = weight.shape[0]
    assert weight.shape == (n, k) and weight.is_contiguous()
    block_n, outputs_per_program = tiles.block_n, tiles.block_n
    if glu:  # n counts outputs (half the weight's rows); a program's rows hold whole (gate, up) pairs
        assert n % 2 == 0, "a (gate | up) projection has an even number of rows"
        n //= 2
        block_n = max(4, block_n)
        outputs_per_program = block_n // 2
    out = torch.empty(m, n, device=x.device, dtype=out_dtype)
    if m == 0:
        return out
    res = residual if residual is not None else x  # unread placeholders where the mode has none
    res_out = residual_out if residual_out is not None else x
    written = (out,) if residual_out is None or residual is None else (out, residual_out)
    deferred_launch.launch(_gemv_kernel, (triton.cdiv(n, outputs_per_program),), (
        x, weight, bias if bias is not None else weight, out, res,
        norm_weight if norm_weight is not None else weight, res_out,
        m, n, k, x.stride(0), weight.stride(0), out.stride(0), res.stride(0), res_out.stride(0), eps,
    ), dict(
        M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=tiles.block_k, HAS_BIAS=bias is not None,
        PEEL_FIRST=tiles.peel_first, PDL=pdl, X_MODE=x_mode, HAS_RESIDUAL=residual is not None,
        K_PAD=triton.next_power_of_2(k) if x_mode == X_NORM else 1,
        EMULATE_BF16=_interpreted() and x.dtype == torch.bfloat16, GLU=glu,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(pdl),
    ), written)
    return out


def _interpreted() -> bool:
    """Kernels run under TRITON_INTERPRET (CPU tests), where bf16 rounding is emulated (kernels/fused.py)."""
    return type(_gemv_kernel).__name__ == "InterpretedFunction"


NORM_FOLD_MAX_K = 8192  # the norm fold loads a whole row of x: 64 fp32 registers a thread at 4 warps, M = 1

_PEEL_MAX_K = 3072  # GemvTiles.peel_first up to this K (Qwen3-0.6B's projections, Llama-3.2-1B's qkv and o)


def choose_gemv_tiles(m: int, n: int, k: int, pdl: bool = False) -> GemvTiles | None:
    """Tiles for y[m, n] = x[m, k] @ W^T, or None where cuBLAS is as fast. A rule read off a sweep
    (benchmarks/kernels/gemv.py; docs/PERFORMANCE.md, "Why these defaults"), from shapes only, so it is fixed
    before capture:
    - m == 1, n <= 8192: faster than cuBLAS on every such projection of Qwen3-0.6B, Llama-3.2-1B and
      Llama-3.1-8B (1.05-3.5x; the Qwen3 gate_up ties). block_n gives ~768-1024 programs.
    - m == 1, wider (gate_up of the 1B and 8B): alone, cuBLAS reads them at 85-97% of HBM bandwidth and is
      1-1.4 us faster; with PDL (kernels/pdl.py) the GEMV's weight read starts during the norm before it and the layer
      stays one chain of PDL launches, which wins the whole step (benchmarks/step/pdl.py --cublas-wide). So the
      GEMV there only with PDL.
    - 2 <= m <= 4, n <= 1024: only there did it beat cuBLAS (Qwen3-0.6B o_proj and down_proj, 1.4-1.9x);
      at wider n the [m, block_n, block_k] accumulator leaves too few programs or too many registers.
      Batch 1's rule at 2-4 rows too, so that the norms before qkv and gate_up fold in, lost whole steps: the
      few-rows kernel with the norm apart stays faster.
    """
    if m == 1 and (n <= 8192 or pdl):
        block_n = 1
        while block_n < 8 and block_n * 2 <= n // 768:
            block_n *= 2
        return GemvTiles(block_n, 1024, peel_first=k <= _PEEL_MAX_K)
    if 2 <= m <= 4 and n <= 1024:
        return GemvTiles(2, 1024, peel_first=k <= _PEEL_MAX_K)
    return None


def _takes(x: torch.Tensor, layer: torch.nn.Linear) -> bool:
    """Whether a Triton kernel may compute layer(x) at all: not a row-parallel layer under tensor parallelism
    (its forward adds the all-reduce, model/parallel.py), nor a quantized one (its own `linear` runs it), x 2-D
    with K contiguous, 16-bit dtypes alike."""
    tp = getattr(layer, "tp", None)
    if isinstance(layer, QuantizedLinear) or (tp is not None and tp.world_size > 1):
        return False
    weight = layer.weight
    return x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype \
        and weight.is_contiguous() and x.stride(-1) == 1 and weight.shape[1] == x.shape[1]


def _layer_tiles(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool) -> GemvTiles | None:
    """The GEMV's tiles for layer(x), x [M, K], or None where layer(x) goes elsewhere (_takes says no, or
    choose_gemv_tiles prefers another kernel at these shapes)."""
    if not _takes(x, layer):
        return None
    return choose_gemv_tiles(x.shape[0], layer.weight.shape[0], x.shape[1], pdl)


def small_batch_linear(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False, glu: bool = False) -> torch.Tensor:
    """layer(x) for x [M, K]: the GEMV where choose_gemv_tiles picks it, else the tensor-core kernel for a few
    rows where skinny.choose_skinny_tiles does (kernels/skinny.py), else cuBLAS (F.linear). For 16-bit CUDA
    tensors (the decoder's Triton kernel set calls it). `layer` is an nn.Linear, or a tensor-parallel one
    (model/parallel.py), which on one rank is an nn.Linear too. glu: silu(gate) * up of the (gate | up)
    projection, folded into the kernel; only where folds_glu(x, layer) said so."""
    if isinstance(layer, QuantizedLinear):
        if glu:  # only where folds_glu said the format's kernel folds it
            return layer.fused_linear(x, pdl=pdl, glu=True)[0]
        return layer.linear(x, pdl=pdl)
    tiles = _triton_tiles(x, layer, pdl)
    if isinstance(tiles, GemvTiles):
        return gemv_linear(x, layer.weight, layer.bias, tiles, pdl=pdl, glu=glu)
    if tiles is not None:
        pdl = pdl and skinny.keeps_pdl(x.shape[0], glu)
        return skinny.skinny_linear(x, layer.weight, layer.bias, tiles, pdl=pdl, glu=glu)
    assert not glu, "folds_glu said no kernel here folds the activation"
    return layer(x)  # F.linear; a row-parallel layer's forward also all-reduces


def _triton_tiles(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool) -> GemvTiles | skinny.SkinnyTiles | None:
    """Which Triton kernel small_batch_linear gives layer(x), by its tiles: the GEMV's, else the few-rows
    kernel's, else None (cuBLAS)."""
    if not _takes(x, layer):
        return None
    m, n, k = x.shape[0], layer.weight.shape[0], x.shape[1]
    tiles = choose_gemv_tiles(m, n, k, pdl)
    if tiles is None and m <= skinny.MAX_ROWS:
        return skinny.choose_skinny_tiles(m, n, k, pdl)
    return tiles


GLU_FOLD_MAX_ROWS = 16  # measured to win at 1, 4, 8 and (launched without PDL there) 16 rows


def choose_glu_fold(m: int, n: int, k: int, pdl: bool = False) -> bool:
    """Whether the SwiGLU activation (silu(gate) * up) folds into the epilogue of the (gate | up) projection's
    GEMV or few-rows kernel at these shapes, one activation kernel fewer per layer. It won whole decode steps
    at 1, 4 and 8 rows. At 16 rows under PDL the kernels took no longer, but the gaps between them grew; with
    the folded gate_up launched without PDL above 8 rows (skinny.keeps_pdl) it wins there too, so the fold is
    on wherever a Triton kernel takes the projection (figures: docs/PERFORMANCE.md, "Why these defaults").
    The 1B and 8B's gate_up at 2-16 rows is cuBLAS's, which folds nothing (folds_glu)."""
    return m <= GLU_FOLD_MAX_ROWS


def folds_glu(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False) -> bool:
    """Whether small_batch_linear (and small_batch_norm_linear, where the norm folds) may take glu=True for
    layer(x), x [M, K]: choose_glu_fold says so and the GEMV or the few-rows kernel computes the projection;
    for a quantized projection, where its format's kernel folds at these rows (QuantizedLinear.folds)."""
    if isinstance(layer, QuantizedLinear):
        return layer.out_features % 2 == 0 and layer.folds(x)
    if _triton_tiles(x, layer, pdl) is None:  # cuBLAS's, or no Triton kernel may take it (_takes)
        return False
    m, n, k = x.shape[0], layer.weight.shape[0], x.shape[1]
    return n % 2 == 0 and choose_glu_fold(m, n, k, pdl)


def small_batch_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                            layer: torch.nn.Linear, pdl: bool = False,
                            glu: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """gemv_norm_linear where the GEMV takes layer's projection of these rows and a row fits the kernel (K <=
    NORM_FOLD_MAX_K), else None (the caller then launches the norm and the projection apart). The folded GEMV
    always peels its first K step, also at K > _PEEL_MAX_K, where the plain GEMV does not.

    Why the peel: every program of the fold first passes over the whole row for its 1/rms; with the first
    weight tile requested before the PDL wait, that pass overlaps the weight read instead of delaying it. On
    Llama-3.1-8B (K 4096) the fold without the peel made the step slower, with it faster (docs/PERFORMANCE.md,
    "Why these defaults"). A quantized projection folds where its format says it does (QuantizedLinear.folds)."""
    if isinstance(layer, QuantizedLinear):
        return _quantized_norm_linear(x, residual, norm_weight, eps, layer, pdl, glu)
    tiles = _layer_tiles(x, layer, pdl)
    if tiles is None or x.shape[1] > NORM_FOLD_MAX_K or norm_weight.dtype != x.dtype \
            or (residual is not None and (residual.dtype != x.dtype or residual.stride(-1) != 1)):
        return None
    return gemv_norm_linear(x, residual, norm_weight, eps, layer.weight, layer.bias, replace(tiles, peel_first=True),
                            pdl=pdl, glu=glu)


def small_batch_glu_linear(gate_up: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False) -> torch.Tensor | None:
    """layer(silu(gate) * up) for gate_up [M, 2K] (gate | up) where layer's kernel computes the activation while it
    prepares its input (QuantizedLinear.takes_glu_input: GGUF's integer-dot rows), else None (the caller then
    launches the activation apart)."""
    if isinstance(layer, QuantizedLinear) and layer.takes_glu_input(gate_up):
        return layer.glu_input_linear(gate_up, pdl)
    return None


def small_batch_linear_norm(x: torch.Tensor, layer: torch.nn.Linear, residual: torch.Tensor, norm_weight: torch.Tensor,
                            eps: float, feeds: torch.nn.Module | None,
                            pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rmsnorm(layer(x) + residual) * norm_weight, layer(x) + residual) out of layer's own launch where its format's
    kernel computes the norm after it at these rows (QuantizedLinear.linear_then_norm), else None. Not where the
    projection the norm feeds (`feeds`; None: none) might take the norm into its own kernel: a 16-bit projection
    (gemv_norm_linear) or a quantized one that folds it (QuantizedLinear.folds); that fold saves the same launch
    without a serial tail."""
    if not isinstance(layer, QuantizedLinear):
        return None
    if feeds is not None and (not isinstance(feeds, QuantizedLinear) or feeds.folds(residual, norm=True)):
        return None  # the residual stands for the next projection's input: same rows, dtype and device
    return layer.linear_then_norm(x, residual, norm_weight, eps, pdl)


def small_batch_int8_input(x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False):
    """Room for layer's input x [M, K] quantized to int8 per 32 values, where layer's kernel reads it so
    (QuantizedLinear.int8_input: GGUF's integer-dot rows) and the kernel that makes x may write it, else None.
    pdl: unused (the kernel set passes it to all)."""
    return layer.int8_input(x) if isinstance(layer, QuantizedLinear) else None


def small_batch_int8_input_linear(qx, x: torch.Tensor, layer: torch.nn.Linear, pdl: bool = False) -> torch.Tensor:
    """layer(x) from small_batch_int8_input(x, layer), filled in."""
    return layer.int8_input_linear(qx, x, pdl)


def _quantized_norm_linear(x, residual, norm_weight, eps, layer, pdl, glu):
    """small_batch_norm_linear for a QuantizedLinear: its fused_linear where folds(x) and a row fits, else None."""
    if not layer.folds(x, norm=True) or x.shape[1] > NORM_FOLD_MAX_K or norm_weight.dtype != x.dtype \
            or (residual is not None and (residual.dtype != x.dtype or residual.stride(-1) != 1)):
        return None
    return layer.fused_linear(x, pdl=pdl, glu=glu, norm=(residual, norm_weight, eps))
