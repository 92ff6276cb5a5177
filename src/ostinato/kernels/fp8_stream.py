"""The streaming W8A16 GEMV for FP8 (E4M3) weights at 1-4 rows: y = x @ (W_fp8 * scale)^T (+ b), fp32 sums,
optionally with the SwiGLU after the projection folded in, as the bf16 GEMV does.

Why another FP8 GEMV (kernels/fp8_gemv.py is the first): that one keeps a 3-D [M_PAD, BLOCK_N, BLOCK_K]
accumulator, and Triton lays a 3-D tensor out one element a thread. Its 16-byte weight loads are re-laid out
through shared memory behind a barrier on every K step; compiled for sm_90 at the 8B's one-row tiles (8 x 1024)
its loop runs 379 instructions a thread for 64 weight bytes, 5.9 a byte, in 130 registers, where the bf16 GEMV
runs 298 for 128 bytes (2.3 a byte).

Here the tile stays in the layout it loads in. The weight is read as int32 words of 4 bytes ([BLOCK_N, BLOCK_J]
words, 4 a thread: one 16-byte load), x as int64 words of 4 values through pointers of the same shape (rows
alike, which the compiler loads once), so x arrives in the weight's layout too; a [BLOCK_K] vector of x would
be re-laid out through shared memory every step. Each word becomes four fp32 planes (value b of every word in
plane b), multiplied plane by plane into one [BLOCK_N, BLOCK_J] accumulator a row of x: a quarter of the first
GEMV's accumulator for the same tile. The same tile compiles to 262 instructions in 80 registers, no barrier
(benchmarks/kernels/fp8_sass.py prints these counts on any machine).

Bytes in flight: the loop is software-pipelined by hand. PREFETCH tiles (1 or 2) are requested ahead of the one
being multiplied and carried as words (16 registers a thread for an 8 KB tile; carried as bytes they were
unpacked and repacked every step, +70% instructions), so the next loads are in flight while this one is
multiplied; the first PREFETCH + 1 tiles are requested before the PDL wait (weights are never written by a
step: kernels/pdl.py). Triton's own pipelining (num_stages) only stages loads that feed tl.dot.

Scales: per row ([N], multiplying each row's sums once at the end) or per block ([cdiv(N, bn), cdiv(K, bk)], bk a
multiple of 4, so a word's four weights share one block): each word's four products are summed, then times its
block's scale. The scale tile is loaded with the weight tile it scales (the same prefetch), from a table small
enough to stay in cache; where a program's rows lie in one row block (every public shape at 128 x 128) the scale
pointers are alike across rows and each scale is loaded once for all of them. At an 8 x 1024 tile the loop runs 299
instructions in 96 registers against per-row scales' 262 in 80 (benchmarks/kernels/fp8_sass.py); at the 8B's 8 x
2048 one-row tile it takes 162 registers against 128. Scaling each weight instead, by a scale gathered per word,
costs four multiplies and a scale load a word where this costs one multiply a word and a load a block.

The RMSNorm before a projection does not fold in here (the bf16 GEMV's does): every program would read the
whole row for its 1/rms and the residual and the norm's weight with each K step, L2 traffic as large as the
weight bytes at 8-row tiles, where the norm kernel reads the row once. Without the fold the 8B's one-row step
was 4% faster (docs/PERFORMANCE.md, FP8). The norm after a projection can come out of it instead
(fp8_stream_then_norm, o_proj's and down_proj's): each program adds the residual to its slice of the output and
stores the sum, then counts itself in on an arrival counter; the last to arrive reads the whole rows once and
normalises them, as the norm kernel would, and one launch and one PDL hop go.

K a multiple of 4 and x's rows 8-byte aligned (stream_takes). Rows past N are clamped onto the last row (read,
never stored); K is masked (a multiple of 64 keeps every load 16 bytes wide). One kernel per call, grid from shapes
only: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels.fp8_gemv import fp8_scale_shape
from ostinato.kernels.pdl import launch_options, pdl_begin, pdl_wait
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)

if triton is not None:  # the torch path needs none of these
    from ostinato.kernels.linear_epilogue import glu_rows, store_glu
    from ostinato.kernels.rounding import rms_norm_row, round_like

MAX_ROWS = 4  # one named accumulator a row


@dataclass(frozen=True)
class StreamTiles:
    """block_n weight rows by block_k inputs per K step; prefetch: K steps requested ahead (1 or 2)."""

    block_n: int
    block_k: int
    prefetch: int = 1
    num_warps: int = 4


@_jit
def _fp8_planes(w, ASM: tl.constexpr):
    """int32 words of four E4M3 bytes -> four fp32 tensors of w's shape, byte b of each word in the b-th. ASM
    (sm_89+): two cvt.rn.f16x2.e4m3x2 and four f16 -> f32 a word, what Triton's own cast emits, but on the
    packed word (taken apart byte by byte, the loop runs about 30% more instructions: sm_90 SASS,
    benchmarks/kernels/fp8_sass.py); the interpreter and older GPUs take the bytes apart."""
    if ASM:
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            """{ .reg .b16 a, b, f0, f1, f2, f3; .reg .b32 lo, hi;
            mov.b32 {a, b}, $4;
            cvt.rn.f16x2.e4m3x2 lo, a; cvt.rn.f16x2.e4m3x2 hi, b;
            mov.b32 {f0, f1}, lo; mov.b32 {f2, f3}, hi;
            cvt.f32.f16 $0, f0; cvt.f32.f16 $1, f1; cvt.f32.f16 $2, f2; cvt.f32.f16 $3, f3; }""",
            "=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        u = w.to(tl.uint32, bitcast=True)
        p0 = (u & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        p1 = ((u >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        p2 = ((u >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        p3 = (u >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return p0, p1, p2, p3


@_jit
def _half_planes(ptr, cols, mask, DT: tl.constexpr):
    """int64 words of four 16-bit values (dtype DT) at ptr + cols -> four fp32 tensors, value b in the b-th."""
    u = tl.load(ptr + cols, mask=mask, other=0).to(tl.uint64, bitcast=True)
    p0 = (u & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    p1 = ((u >> 16) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    p2 = ((u >> 32) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    p3 = (u >> 48).to(tl.uint16).to(DT, bitcast=True).to(tl.float32)
    return p0, p1, p2, p3


@_jit
def _row_dot(acc, w0, w1, w2, w3, x_ptr, x64_ptr, stride_xm, row, M, cols, K4, sc, BLOCK_SCALES: tl.constexpr):
    """acc + the four weight planes times row `row` of x at the int64 words cols, [BLOCK_N, BLOCK_J], times the
    words' block scales sc with BLOCK_SCALES. x is loaded through pointers of the weight tile's shape, rows alike,
    so it comes in the weight tile's layout (a [BLOCK_J] vector would be re-laid out through shared memory each
    step); the compiler sees the rows are alike and loads each word once. A word's four products share one
    block, so its scale multiplies their sum: one instruction a word (scaling the four weights, or the x values per
    weight row, took four)."""
    r = tl.minimum(row, M - 1)
    mask = cols < K4
    x0, x1, x2, x3 = _half_planes(x64_ptr + r * stride_xm, cols, mask, x_ptr.dtype.element_ty)
    if BLOCK_SCALES:
        return acc + (w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3) * sc
    return acc + w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3


@_jit
def _store_row(out_ptr, y, s, b_ptr, res_ptr, w_index, offs_n, pid, row, M, N, stride_om, stride_rm,
               HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, GLU: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
               EMULATE_BF16: tl.constexpr):
    """Row `row`'s sums y [BLOCK_N] times the weight rows' scales s (+ bias), stored (GLU: as silu(gate) * up;
    ADD_RESIDUAL: the output rounded to the model dtype plus the residual's row, rounded again, as the norm kernel
    adds them)."""
    y = y * s
    if HAS_BIAS:
        y += tl.load(b_ptr + w_index).to(tl.float32)
    offs_m = row + tl.zeros([1], tl.int32)
    if GLU:
        cols = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        store_glu(out_ptr, y[None, :], offs_m, cols, (offs_m < M)[:, None] & (cols < N)[None, :], stride_om, 1,
                  BLOCK_N, EMULATE_BF16)
    else:
        mask = (offs_n < N) & (offs_n * 0 + row < M)  # a tensor: the interpreter takes no Python bool in a mask
        if ADD_RESIDUAL:
            res = tl.load(res_ptr + row * stride_rm + offs_n, mask=mask, other=0.0).to(tl.float32)
            y = round_like(round_like(y, out_ptr, EMULATE_BF16) + res, out_ptr, EMULATE_BF16)
        elif EMULATE_BF16:  # the interpreter's cast truncates: round to nearest as the GPU's store does
            y = round_like(y, out_ptr, EMULATE_BF16)
        tl.store(out_ptr + row * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask)


@_jit
def _norm_when_last(sum_ptr, nw_ptr, normed_ptr, counter_ptr, N, stride_sm, stride_nm, eps, ROWS: tl.constexpr,
                    BLOCK_H: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """Counts this program in; the one that arrives last normalises the whole rows of sum_ptr (every program's
    slice, the residual added) with the norm's weight into normed_ptr, as the norm kernel does, and zeroes the
    counter for the next launch. The stores are published before the count: a barrier, then the release half of
    the counter's acq_rel (kernels/decode_attention.py's merge does the same)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.debug_barrier()
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
        offs = tl.arange(0, BLOCK_H)
        mask = offs < N
        w = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for row in tl.static_range(ROWS):
            h = tl.load(sum_ptr + row * stride_sm + offs, mask=mask, other=0.0).to(tl.float32)
            y = rms_norm_row(h, w, N, eps, normed_ptr, EMULATE_BF16)
            tl.store(normed_ptr + row * stride_nm + offs, y.to(normed_ptr.dtype.element_ty), mask=mask)


@_jit
def _w_words(w_rows, j0, offs_j, K4):
    """The [BLOCK_N, BLOCK_J] tile of int32 weight words at j0 + offs_j (zeros past the row: a prefetch past the
    end reads nothing)."""
    js = j0 + offs_j
    return tl.load(w_rows + js[None, :], mask=(js < K4)[None, :], other=0)


@_jit
def _scale_rows(s_ptr, pid, w_index, N, stride_sn, BLOCK_N: tl.constexpr, GLU: tl.constexpr,
                SCALE_BN: tl.constexpr, UNIFORM: tl.constexpr):
    """[BLOCK_N, 1] pointers to each weight row's row of the block-scale table. UNIFORM (the wrapper checked that
    a program's rows, each GLU half's apart, lie in one row block): taken from the program id, so that all rows'
    pointers are one expression (two with GLU) and the compiler loads each scale once for all of them."""
    if UNIFORM:
        first = pid * (BLOCK_N // 2 if GLU else BLOCK_N)
        rows = first // SCALE_BN + tl.zeros([BLOCK_N], tl.int32)
        if GLU:
            rows = tl.where(tl.arange(0, BLOCK_N) % 2 == 0, rows, (N + first) // SCALE_BN)  # gate, up rows
    else:
        rows = w_index // SCALE_BN
    return s_ptr + rows[:, None] * stride_sn


@_jit
def _scale_tile(s_rows, j0, offs_j, K4, WORDS_PER_BLOCK: tl.constexpr, BLOCK_J: tl.constexpr, EVEN_J: tl.constexpr):
    """The block scales of the words j0 + offs_j, [BLOCK_N, BLOCK_J]. EVEN_J (K4 a multiple of BLOCK_J): the step
    past the end (the last prefetch) re-reads the last step's, a scalar clamp; else each word past the row reads
    the last block's. Either way the weights they meet there are 0."""
    if EVEN_J:
        return tl.load(s_rows + ((tl.minimum(j0, K4 - BLOCK_J) + offs_j) // WORDS_PER_BLOCK)[None, :])
    return tl.load(s_rows + (tl.minimum(j0 + offs_j, K4 - 1) // WORDS_PER_BLOCK)[None, :])


@_jit
def _fp8_stream_kernel(
    x_ptr, x64_ptr, w_ptr, s_ptr, b_ptr, out_ptr, res_ptr, nw_ptr, normed_ptr, counter_ptr, M, N, K, stride_x64,
    stride_wn, stride_sn, stride_om, stride_rm, stride_nm, eps,
    ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_J: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_BIAS: tl.constexpr, GLU: tl.constexpr, ASM: tl.constexpr, EMULATE_BF16: tl.constexpr, PDL: tl.constexpr,
    BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, WORDS_PER_BLOCK: tl.constexpr, UNIFORM: tl.constexpr,
    EVEN_J: tl.constexpr, NORM_AFTER: tl.constexpr, BLOCK_H: tl.constexpr,
):
    pdl_begin(PDL)
    pid = tl.program_id(0)
    K4 = K // 4  # words a row: w_ptr holds int32 words of 4 weights, x64_ptr int64 words of 4 values
    offs_n, w_index = glu_rows(pid, N, BLOCK_N, GLU)  # each row's output; its row of W
    if GLU:
        w_index = tl.minimum(w_index, 2 * N - 1)  # rows past the end read the last row, never stored
    else:
        w_index = tl.minimum(w_index, N - 1)
    w_rows = w_ptr + w_index.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    offs_j = tl.arange(0, BLOCK_J)
    w_next = _w_words(w_rows, 0, offs_j, K4)  # the pipeline's head, requested before the wait
    w_after = w_next
    if PREFETCH == 2:
        w_after = _w_words(w_rows, BLOCK_J, offs_j, K4)
    if BLOCK_SCALES:  # requested with the weights they scale, so their loads are in flight together
        s_rows = _scale_rows(s_ptr, pid, w_index, N, stride_sn, BLOCK_N, GLU, SCALE_BN, UNIFORM)
        s_next = _scale_tile(s_rows, 0, offs_j, K4, WORDS_PER_BLOCK, BLOCK_J, EVEN_J)
        s_after = s_next
        if PREFETCH == 2:
            s_after = _scale_tile(s_rows, BLOCK_J, offs_j, K4, WORDS_PER_BLOCK, BLOCK_J, EVEN_J)
    pdl_wait(PDL)
    acc0 = tl.zeros([BLOCK_N, BLOCK_J], tl.float32)
    acc1, acc2, acc3 = acc0, acc0, acc0
    for j0 in range(0, K4, BLOCK_J):
        w = w_next
        if PREFETCH == 2:
            w_next = w_after
            w_after = _w_words(w_rows, j0 + 2 * BLOCK_J, offs_j, K4)
        else:
            w_next = _w_words(w_rows, j0 + BLOCK_J, offs_j, K4)
        if BLOCK_SCALES:
            sc = s_next
            if PREFETCH == 2:
                s_next = s_after
                s_after = _scale_tile(s_rows, j0 + 2 * BLOCK_J, offs_j, K4, WORDS_PER_BLOCK, BLOCK_J, EVEN_J)
            else:
                s_next = _scale_tile(s_rows, j0 + BLOCK_J, offs_j, K4, WORDS_PER_BLOCK, BLOCK_J, EVEN_J)
        else:
            sc = 1.0  # unread
        cols = j0 + offs_j[None, :] + tl.zeros([BLOCK_N, 1], tl.int32)  # [BLOCK_N, BLOCK_J], rows alike
        w0, w1, w2, w3 = _fp8_planes(w, ASM)
        acc0 = _row_dot(acc0, w0, w1, w2, w3, x_ptr, x64_ptr, stride_x64, 0, M, cols, K4, sc, BLOCK_SCALES)
        if ROWS > 1:
            acc1 = _row_dot(acc1, w0, w1, w2, w3, x_ptr, x64_ptr, stride_x64, 1, M, cols, K4, sc, BLOCK_SCALES)
        if ROWS > 2:
            acc2 = _row_dot(acc2, w0, w1, w2, w3, x_ptr, x64_ptr, stride_x64, 2, M, cols, K4, sc, BLOCK_SCALES)
        if ROWS > 3:
            acc3 = _row_dot(acc3, w0, w1, w2, w3, x_ptr, x64_ptr, stride_x64, 3, M, cols, K4, sc, BLOCK_SCALES)
    s = 1.0
    if not BLOCK_SCALES:
        s = tl.load(s_ptr + w_index)
    _store_row(out_ptr, tl.sum(acc0, axis=1), s, b_ptr, res_ptr, w_index, offs_n, pid, 0, M, N, stride_om,
               stride_rm, HAS_BIAS, BLOCK_N, GLU, NORM_AFTER, EMULATE_BF16)
    if ROWS > 1:
        _store_row(out_ptr, tl.sum(acc1, axis=1), s, b_ptr, res_ptr, w_index, offs_n, pid, 1, M, N, stride_om,
                   stride_rm, HAS_BIAS, BLOCK_N, GLU, NORM_AFTER, EMULATE_BF16)
    if ROWS > 2:
        _store_row(out_ptr, tl.sum(acc2, axis=1), s, b_ptr, res_ptr, w_index, offs_n, pid, 2, M, N, stride_om,
                   stride_rm, HAS_BIAS, BLOCK_N, GLU, NORM_AFTER, EMULATE_BF16)
    if ROWS > 3:
        _store_row(out_ptr, tl.sum(acc3, axis=1), s, b_ptr, res_ptr, w_index, offs_n, pid, 3, M, N, stride_om,
                   stride_rm, HAS_BIAS, BLOCK_N, GLU, NORM_AFTER, EMULATE_BF16)
    if NORM_AFTER:
        _norm_when_last(out_ptr, nw_ptr, normed_ptr, counter_ptr, N, stride_om, stride_nm, eps, ROWS, BLOCK_H,
                        EMULATE_BF16)


def stream_takes(x: torch.Tensor, weight: torch.Tensor, block: tuple[int, int] | None = None) -> bool:
    """Whether fp8_stream may compute x @ weight^T: 1-4 rows of 16-bit x, K a multiple of 4 (the kernel reads
    4 values a word) and so the scale blocks' K width, x's rows and storage 8-byte aligned."""
    m, k = x.shape
    return 1 <= m <= MAX_ROWS and k % 4 == 0 and x.dtype in (torch.bfloat16, torch.float16) \
        and (block is None or block[1] % 4 == 0) \
        and x.stride(-1) == 1 and x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0 and weight.is_contiguous()


def _uniform_scale_rows(bn: int, rows_per_program: int, n: int, glu: bool) -> bool:
    """Whether each program's weight rows (with glu, its gate rows and its up rows apart) lie in one row block of
    bn rows: its outputs start at multiples of rows_per_program, and glu's up half at n // 2."""
    return bn % rows_per_program == 0 and (not glu or (n // 2) % bn == 0)


def _words(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [.., K] tensor (K contiguous) as words of 4 values (int32 for fp8, int64 for 16-bit), same memory."""
    return t.view(dtype)


@dataclass(frozen=True)
class ResidualNorm:
    """The RMSNorm after a projection, with the residual add before it (kernels/fused.py's fused_add_rms_norm):
    residual [M, N] in the projection's dtype, the norm's weight [N] and eps. counter: one int32, zero between
    launches (kernels/split_counters.py), that counts the programs in so that the last can normalise the rows."""

    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    counter: torch.Tensor


def fp8_stream(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
               tiles: StreamTiles, pdl: bool = False, glu: bool = False,
               block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ (weight [N, K] fp8 * scale)^T (+ bias) -> [M, N] in x's dtype; stream_takes(x, weight, block)
    must hold. scale: [N] float32 (per row) or, with `block` (bn, bk), [cdiv(N, bn), cdiv(K, bk)] float32.
    glu: weight is (gate | up) [2I, K]; the output is silu(gate) * up [M, I] (block_n then counts weight rows).
    pdl: launch with programmatic dependent launch (kernels/pdl.py)."""
    n = weight.shape[0] // 2 if glu else weight.shape[0]
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    _launch(x, weight, scale, bias, tiles, pdl, glu, block, out, None, None)
    return out


def fp8_stream_then_norm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                         tiles: StreamTiles, norm: ResidualNorm, pdl: bool = False,
                         block: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_stream's projection, then the residual add and the RMSNorm after it, in the same launch:
    (rmsnorm(y + residual) * norm.weight, y + residual), y = x @ W^T rounded to x's dtype, both [M, N] and new
    tensors. The programs store their slices of the sum and count themselves in; the last one normalises the
    whole rows. Why: at one row the norm as its own kernel is one more launch and PDL hop twice a layer, and the
    norm folded into the projection after it re-reads the row in every program (the module doc)."""
    m, n = x.shape[0], weight.shape[0]
    assert norm.residual.shape == (m, n) and norm.residual.dtype == x.dtype and norm.residual.stride(-1) == 1
    assert norm.weight.shape == (n,) and norm.weight.is_contiguous() and norm.counter.dtype == torch.int32
    total = torch.empty(m, n, device=x.device, dtype=x.dtype)
    normed = torch.empty_like(total)
    _launch(x, weight, scale, bias, tiles, pdl, False, block, total, norm, normed)
    return normed, total


def _launch(x, weight, scale, bias, tiles, pdl, glu, block, out, norm: ResidualNorm | None, normed) -> None:
    """One launch of the kernel writing out (with norm: the sums, and the normed rows into normed)."""
    m, k = x.shape
    n = weight.shape[0]
    assert stream_takes(x, weight, block) and weight.shape == (n, k) and scale.shape == fp8_scale_shape(n, k, block)
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    assert 1 <= tiles.prefetch <= 2 and tiles.block_k % 4 == 0
    assert not glu or (n % 2 == 0 and tiles.block_n >= 2)
    outputs, rows_per_program = (n // 2, tiles.block_n // 2) if glu else (n, tiles.block_n)
    if n == 0:
        return
    interpreted = type(_fp8_stream_kernel).__name__ == "InterpretedFunction"
    # cvt.rn.f16x2.e4m3x2 is sm_89 and newer; older GPUs take the plain path (Triton's own conversion)
    asm = not interpreted and torch.cuda.get_device_capability(x.device) >= (8, 9)
    unread = scale  # stands for the pointers a launch without them never reads
    residual, norm_weight, counter = (norm.residual, norm.weight, norm.counter) if norm else (unread,) * 3
    _fp8_stream_kernel[(triton.cdiv(outputs, rows_per_program),)](
        x, _words(x, torch.int64), weight.view(torch.int32), scale, bias if bias is not None else unread, out,
        residual, norm_weight, normed if normed is not None else unread, counter,
        m, outputs, k, x.stride(0) // 4, k // 4, scale.stride(0), out.stride(0), residual.stride(0),
        normed.stride(0) if normed is not None else 0, norm.eps if norm else 0.0,
        ROWS=m, BLOCK_N=tiles.block_n, BLOCK_J=tiles.block_k // 4, PREFETCH=tiles.prefetch,
        HAS_BIAS=bias is not None, GLU=glu, ASM=asm, EMULATE_BF16=interpreted and x.dtype == torch.bfloat16, PDL=pdl,
        BLOCK_SCALES=block is not None, SCALE_BN=block[0] if block is not None else 1,
        WORDS_PER_BLOCK=block[1] // 4 if block is not None else 1,
        UNIFORM=block is not None and _uniform_scale_rows(block[0], rows_per_program, n, glu),
        EVEN_J=k % tiles.block_k == 0, NORM_AFTER=norm is not None,
        BLOCK_H=triton.next_power_of_2(outputs) if norm else 1,
        num_warps=tiles.num_warps, num_stages=1, **launch_options(pdl),
    )
