"""The dense logits processors of a decode row as one Triton kernel: the count penalties, then min_p.

Why a kernel: in torch the penalties are a gather of the rows' [B, V] token counts and a few [B, V] passes
over the logits, paid by every row of the graph whether it asked for a penalty or not. Here one program per
row reads its flags first; a row whose flags are off runs no iteration of either pass, so it reads no logits
and no counts (a few microseconds for the whole batch, whatever the vocabulary).

A row with the penalty bit: for each token, with c = counts[slot, token] (low bits: times the token was
generated; PROMPT_BIT: it is in the prompt), a token seen (c != 0) has its logit divided by the repetition
penalty when positive and multiplied by it otherwise (HF's RepetitionPenaltyLogitsProcessor), and then loses
frequency * count + presence * (count > 0) (OpenAI's). A row with the min_p bit then drops (to -inf) every
token whose logit is below max + T * log(min_p): the tokens less likely than min_p times the most likely
one at temperature T (HF's MinPLogitsWarper, without materializing the softmax). The same program writes and
then reads a token, so no barrier is needed between the two passes.
"""

from __future__ import annotations

import torch

from ostinato.kernels import deferred_launch
from ostinato.kernels.triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)

_BLOCK = 2048


def _jit(fn):
    # The rows' stride differs between the decode rows and a prefill draw's settings rows: not specialized
    # on, so both run the variant the decode graphs' capture compiled.
    return triton.jit(do_not_specialize=["stride_r"])(fn) if triton is not None else fn


@_jit
def _penalties_kernel(logits_ptr, stride_l, rows_ptr, stride_r, counts_ptr, stride_c, vocab,
                      SLOT: tl.constexpr, FLAGS: tl.constexpr, TEMP: tl.constexpr, REP: tl.constexpr,
                      PRES: tl.constexpr, FREQ: tl.constexpr, MIN_P: tl.constexpr, PENALTY_BIT: tl.constexpr,
                      MINP_BIT: tl.constexpr, COUNT_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    r = rows_ptr + row * stride_r
    flags = tl.load(r + FLAGS)
    # How far each pass reads: the vocabulary when the row has it on, nothing otherwise (every access masked).
    pen_end = tl.where((flags & PENALTY_BIT) != 0, vocab, 0)
    minp_end = tl.where((flags & MINP_BIT) != 0, vocab, 0)
    read_end = tl.maximum(pen_end, minp_end)
    rep = tl.load(r + REP).to(tl.float32, bitcast=True)
    pres = tl.load(r + PRES).to(tl.float32, bitcast=True)
    freq = tl.load(r + FREQ).to(tl.float32, bitcast=True)
    base = logits_ptr + row * stride_l
    counts = counts_ptr + tl.load(r + SLOT).to(tl.int64) * stride_c
    offs0 = tl.arange(0, BLOCK)
    run_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for k0 in range(0, read_end, BLOCK):  # no iteration on a row without them
        offs = k0 + offs0
        x = tl.load(base + offs, mask=offs < read_end, other=float("-inf")).to(tl.float32)
        c = tl.load(counts + offs, mask=offs < pen_end, other=0)
        n = (c & COUNT_MASK).to(tl.float32)
        y = tl.where(c != 0, tl.where(x > 0, x / rep, x * rep), x)
        y = y - freq * n - tl.where(n > 0, pres, 0.0)
        tl.store(base + offs, y, mask=offs < pen_end)
        x = tl.where(offs < pen_end, y, x)
        run_max = tl.maximum(run_max, tl.where(offs < minp_end, x, float("-inf")))
    t = tl.load(r + TEMP).to(tl.float32, bitcast=True)
    min_p = tl.load(r + MIN_P).to(tl.float32, bitcast=True)
    threshold = tl.max(run_max, 0) + t * tl.log(tl.maximum(min_p, 1e-30))
    for k0 in range(0, minp_end, BLOCK):
        offs = k0 + offs0
        x = tl.load(base + offs, mask=offs < minp_end, other=0.0).to(tl.float32)
        tl.store(base + offs, tl.full([BLOCK], float("-inf"), tl.float32), mask=(offs < minp_end) & (x < threshold))


def available_for(logits: torch.Tensor) -> bool:
    """True where the kernel runs: CUDA tensors with triton installed (CPU tests call apply() under
    TRITON_INTERPRET=1 directly). Shapes only: the choice is fixed per graph."""
    return triton is not None and logits.is_cuda


def apply(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, columns: dict[str, int],
          bits: dict[str, int], count_mask: int, block: int = _BLOCK) -> None:
    """In place on float32 logits [B, V] (vocabulary contiguous), from the int32 rows [>= B, width] holding
    each row's flags and settings at `columns` (SLOT FLAGS TEMP REP PRES FREQ MIN_P) and the int32 counts
    [slots, V]. `bits`: the flags' PENALTY and MINP bits. Capturable (grid from shapes only)."""
    b, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(-1) == 1
    assert rows.dtype == torch.int32 and rows.stride(-1) == 1 and counts.dtype == torch.int32
    if b == 0:
        return
    # In place: deferred (kernels/deferred_launch.py), the logits stay as they came.
    deferred_launch.launch(_penalties_kernel, (b,), (
        logits, logits.stride(0), rows, rows.stride(0), counts, counts.stride(0), vocab,
    ), dict(**columns, PENALTY_BIT=bits["PENALTY"], MINP_BIT=bits["MINP"], COUNT_MASK=count_mask,
            BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8), ())
