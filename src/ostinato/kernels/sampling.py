"""`sample_tokens` as two Triton kernels over the vocabulary split in chunks: greedy and temperature rows.

Why: the torch path (runner/sampler.py) is ~25 small kernels inside the decode graph (the row hash, an
argmax, a float32 [B, V] copy, its max, exp, a cumulative sum, a search, a select), and the argmax and the
cumulative sum alone took a large share of a small model's step (`ostinato bench kernels`; docs/PERFORMANCE.md,
"Why these defaults"). So did one program walking a whole row. A row is 0.5-0.6 MB of float32 logits: read once
by many programs it costs a few microseconds.

Algorithm (both launches have a grid from shapes only, so a captured graph stays valid):
    chunks  grid (B, num_chunks). A program reads its chunk of the row once, scaled by 1 / T (by 1 on greedy
            rows), and stores its max, its first argmax and its mass sum(exp(x / T - max)) (online, in fp32).
    pick    grid (B,). A greedy row takes the argmax of the chunk holding the first row-wide max: the first
            index of the max, as torch.argmax. A sampled row draws u from its key and counter (the hash of
            sampler.uniform, bit for bit), finds the chunk where u * total mass falls in the chunks' running
            sum, and walks that one chunk for the index: the number of entries whose running sum stays <=
            u * total, i.e. torch.searchsorted(cdf, u * total, right=True) of the torch path, clamped to the
            last index. Both write the token id straight into the caller's int64 output.
Chunks: enough that B * num_chunks fills the GPU (4 programs per SM), each at least one tile and at most
CHUNK_MAX entries (the pick's walk). A 152k vocabulary is 149 chunks of 1024 at batch 1, 38 of 4096 at batch
16, 19 of 8192 from batch 32 on.

Differences from the torch path: the summation order, so a u within float rounding of the boundary between
two tokens may pick the other one. Nothing else: the same u, the same greedy tie rule, no temporaries but
three [B, num_chunks] partials.

Settings come as int32 columns of packed rows (`RowColumns`): the decode step passes its persistent rows as
they are (no unpacking kernels in the graph), prefill the setting columns of the rows its sequences joined at
(runner/sampling_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ostinato.kernels import deferred_launch
from ostinato.kernels.triton_optional import jit as _jit
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernels' annotations)

_BLOCK = 1024  # entries per tile
CHUNK_MAX = 8192  # entries per chunk at most: the pick walks one chunk of a sampled row
_PROGRAMS_PER_SM = 4


@dataclass(frozen=True)
class RowColumns:
    """Where a row's settings sit in packed int32 rows: the sampling counter, the temperature (float32
    bits), and the two int32 halves of the 64-bit key."""

    counter: int
    temperature: int
    key_lo: int
    key_hi: int


@_jit
def _row_temperature(rows_ptr, row, stride_r, TEMP: tl.constexpr):
    return tl.load(rows_ptr + row * stride_r + TEMP).to(tl.float32, bitcast=True)


@_jit
def _uniform(key_lo, key_hi, counter):
    """sampler.uniform on the device: splitmix64(key ^ counter), top 24 bits / 2**24 (uint64 wraps)."""
    key = (key_hi.to(tl.uint32, bitcast=True).to(tl.uint64) << 32) | key_lo.to(tl.uint32, bitcast=True).to(tl.uint64)
    x = (key ^ counter.to(tl.int64).to(tl.uint64, bitcast=True)) + 0x9E3779B97F4A7C15
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB
    x = x ^ (x >> 31)
    return (x >> 40).to(tl.float32) * (1.0 / 16777216.0)


@_jit
def _sample_chunk_kernel(logits_ptr, stride_l, rows_ptr, stride_r, part_max_ptr, part_sum_ptr, part_arg_ptr,
                         vocab, chunk, num_chunks, greedy_below, TEMP: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    t = _row_temperature(rows_ptr, row, stride_r, TEMP)
    divisor = tl.where(t < greedy_below, 1.0, t)
    base = logits_ptr + row * stride_l
    start = c * chunk
    end = tl.minimum(start + chunk, vocab)
    offs0 = tl.arange(0, BLOCK)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    arg = start
    for k0 in range(start, end, BLOCK):
        offs = k0 + offs0
        x = tl.load(base + offs, mask=offs < end, other=float("-inf")).to(tl.float32) / divisor
        tile_max = tl.max(x, 0)
        # Strictly greater: an equal max in a later tile keeps the earlier index (torch.argmax's first).
        arg = tl.where(tile_max > m, k0 + tl.argmax(x, 0, tie_break_left=True), arg)
        m_new = tl.maximum(m, tile_max)
        # -inf logits (none come from a model, but no NaN either way): they add 0 mass.
        alpha = tl.where(m_new == float("-inf"), 1.0, tl.exp(m - m_new))
        p = tl.where(x == float("-inf"), 0.0, tl.exp(x - m_new))
        s = s * alpha + tl.sum(p, 0)
        m = m_new
    idx = row * num_chunks + c
    tl.store(part_max_ptr + idx, m)
    tl.store(part_sum_ptr + idx, s)
    tl.store(part_arg_ptr + idx, arg)


@_jit
def _sample_pick_kernel(logits_ptr, stride_l, rows_ptr, stride_r, part_max_ptr, part_sum_ptr, part_arg_ptr,
                        out_ptr, vocab, chunk, num_chunks, greedy_below, CTR: tl.constexpr, TEMP: tl.constexpr,
                        KEY_LO: tl.constexpr, KEY_HI: tl.constexpr, CHUNKS_PAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs_c = tl.arange(0, CHUNKS_PAD)
    c_mask = offs_c < num_chunks
    parts = row * num_chunks + offs_c
    part_max = tl.load(part_max_ptr + parts, mask=c_mask, other=float("-inf"))  # [CHUNKS_PAD]
    m = tl.max(part_max, 0)
    t = _row_temperature(rows_ptr, row, stride_r, TEMP)
    if t < greedy_below:
        first = tl.min(tl.where(c_mask & (part_max == m), offs_c, CHUNKS_PAD), 0)
        tl.store(out_ptr + row, tl.load(part_arg_ptr + row * num_chunks + first).to(tl.int64))
    else:
        part_sum = tl.load(part_sum_ptr + parts, mask=c_mask, other=0.0)
        mass = tl.where(c_mask & (part_max > float("-inf")), part_sum * tl.exp(part_max - m), 0.0)
        u = _uniform(tl.load(rows_ptr + row * stride_r + KEY_LO), tl.load(rows_ptr + row * stride_r + KEY_HI),
                     tl.load(rows_ptr + row * stride_r + CTR))
        target = u * tl.sum(mass, 0)
        # The chunk where the running mass passes target: the count of chunks whose running sum stays <= it
        # (chunks of zero mass in between are skipped, as right=True skips zero-probability tokens).
        c_star = tl.minimum(tl.sum(((tl.cumsum(mass, 0) <= target) & c_mask).to(tl.int32), 0), num_chunks - 1)
        running = tl.sum(tl.where(offs_c < c_star, mass, 0.0), 0)
        start = c_star * chunk
        end = tl.minimum(start + chunk, vocab)
        offs0 = tl.arange(0, BLOCK)
        count = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
        for k0 in range(start, end, BLOCK):
            offs = k0 + offs0
            mask = offs < end
            x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32) / t
            p = tl.where(mask & (x > float("-inf")), tl.exp(x - m), 0.0)
            count += tl.sum(((tl.cumsum(p, 0) + running <= target) & mask).to(tl.int32), 0)
            running += tl.sum(p, 0)
        tl.store(out_ptr + row, tl.minimum(start + count, end - 1).to(tl.int64))


@dataclass(frozen=True)
class ChunkPlan:
    block: int
    chunk: int
    num_chunks: int


def plan_chunks(rows: int, vocab: int, num_sms: int, block: int = _BLOCK, chunk_max: int = CHUNK_MAX) -> ChunkPlan:
    """Chunks of the vocabulary for B rows, from shapes only (fixed before capture): B * num_chunks >= 4
    programs per SM where chunks of one tile allow it; at most chunk_max entries each."""
    block = min(block, triton.next_power_of_2(vocab))
    wanted = max(1, -(-_PROGRAMS_PER_SM * num_sms // rows))
    chunk = -(-vocab // wanted) // block * block  # rounded down: at least `wanted` chunks
    chunk = max(block, min(chunk, max(chunk_max, block)))
    return ChunkPlan(block, chunk, -(-vocab // chunk))


def plan_representatives(max_rows: int, vocab: int, num_sms: int) -> list[int]:
    """The smallest row count of each distinct ChunkPlan for 1..max_rows rows: sampling these compiles every
    variant the two kernels meet at those row counts (Triton specialises on chunk and num_chunks, and the pick
    takes CHUNKS_PAD as a constant). A 128k or 152k vocabulary on 132 SMs has 8 plans up to 256 rows."""
    reps: dict[ChunkPlan, int] = {}
    for rows in range(1, max_rows + 1):
        reps.setdefault(plan_chunks(rows, vocab, num_sms), rows)
    return sorted(reps.values())


def available_for(logits: torch.Tensor) -> bool:
    """True where the kernels run: CUDA tensors with triton installed (CPU tests call sample() under
    TRITON_INTERPRET=1 directly). Shapes only: the choice is fixed per graph."""
    return triton is not None and logits.is_cuda


def sample(logits: torch.Tensor, rows: torch.Tensor, columns: RowColumns, out: torch.Tensor, greedy_below: float,
           num_sms: int, block: int = _BLOCK, chunk_max: int = CHUNK_MAX, batch_invariant: bool = False) -> None:
    """logits [B, V] (any float dtype, vocabulary contiguous), rows [B, >= 4] int32 holding the settings at
    `columns` -> out [B] int64: the argmax on rows with temperature < greedy_below, a draw from
    softmax(logits / T) on the others. `block` / `chunk_max` shrink the tiles in tests.

    batch_invariant: chunks planned as for one row, whatever B is. The chunks set the order of a sampled row's
    mass sums, and a u within their rounding of a boundary between two tokens picks the one or the other: with
    chunks planned for B rows, a seeded row could draw another token in another batch (or graph size)."""
    b, vocab = logits.shape
    assert logits.stride(-1) == 1, "logits: the vocabulary dimension must be contiguous"
    assert rows.dtype == torch.int32 and rows.shape[0] >= b and rows.stride(-1) == 1
    assert out.dtype == torch.int64 and out.shape == (b,) and out.is_contiguous()
    if b == 0:
        return
    plan = plan_chunks(1 if batch_invariant else b, vocab, num_sms, block, chunk_max)
    part_max = torch.empty(b, plan.num_chunks, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty(b, plan.num_chunks, dtype=torch.int32, device=logits.device)
    common = (vocab, plan.chunk, plan.num_chunks, greedy_below)
    deferred_launch.launch(_sample_chunk_kernel, (b, plan.num_chunks), (
        logits, logits.stride(0), rows, rows.stride(0), part_max, part_sum, part_arg, *common,
    ), dict(TEMP=columns.temperature, BLOCK=plan.block, num_warps=4), (part_max, part_sum, part_arg))
    deferred_launch.launch(_sample_pick_kernel, (b,), (
        logits, logits.stride(0), rows, rows.stride(0), part_max, part_sum, part_arg, out, *common,
    ), dict(CTR=columns.counter, TEMP=columns.temperature, KEY_LO=columns.key_lo, KEY_HI=columns.key_hi,
            CHUNKS_PAD=triton.next_power_of_2(plan.num_chunks), BLOCK=plan.block, num_warps=4), (out,))
