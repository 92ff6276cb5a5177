"""The draw of `sample_tokens` as one Triton kernel: softmax(logits / T) and its inverse CDF, per row.

Why: the torch path (runner/sampler._inverse_cdf) materialises a float32 [B, V] copy of the logits and runs
a cumulative sum over it. Inside the decode graph that cumsum alone took 235 µs of a 2.7 ms step
(qwen3-0.6b shape, batch 64, H200 profile), and the [B, V] buffer stays allocated in the graph pool.
Here one program per row reads its logits three times (max, total mass, then the running sum) and writes
one index: no [B, V] temporary, and the rows run in parallel across the SMs.

Same draw as the torch path: p_i = exp(logits_i / T - max), the index is the number of entries whose
running sum is <= u * total (torch.searchsorted(..., right=True)), clamped to V - 1. Summation order
differs from torch's cumsum, so a u that falls within float rounding of a boundary between two tokens
may pick the other one; nothing else differs. Greedy rows (T below the threshold) divide by 1 and their
draw is discarded by the caller.

CUDA graphs: the grid is (B,), nothing reads a tensor value on the host.
"""

from __future__ import annotations

import torch

from ..triton_optional import jit as _jit
from ..triton_optional import tl, triton  # noqa: F401  (tl: the kernel's annotations)

# Entries per tile: large enough that a 152k vocabulary is ~37 tiles per pass.
_BLOCK = 4096


@_jit
def _inverse_cdf_kernel(logits_ptr, stride_row, temperature_ptr, u_ptr, out_ptr, vocab, greedy_below,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    t = tl.load(temperature_ptr + row)
    divisor = tl.where(t < greedy_below, 1.0, t)
    offs0 = tl.arange(0, BLOCK)

    # Pass 1: the row's largest scaled logit.
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), 0)
    for start in range(0, vocab, BLOCK):
        offs = start + offs0
        x = tl.load(base + offs, mask=offs < vocab, other=float("-inf")).to(tl.float32) / divisor
        m = tl.maximum(m, tl.max(x, 0))

    # Pass 2: the total mass, summed tile by tile exactly as pass 3 sums it.
    total = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    for start in range(0, vocab, BLOCK):
        offs = start + offs0
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / divisor
        total += tl.sum(tl.where(mask, tl.exp(x - m), 0.0), 0)

    # Pass 3: count the entries whose running sum stays <= u * total.
    target = tl.load(u_ptr + row) * total
    running = tl.sum(tl.zeros([BLOCK], tl.float32), 0)
    count = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for start in range(0, vocab, BLOCK):
        offs = start + offs0
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) / divisor
        p = tl.where(mask, tl.exp(x - m), 0.0)
        cdf = tl.cumsum(p, 0) + running
        count += tl.sum(((cdf <= target) & mask).to(tl.int32), 0)
        running += tl.sum(p, 0)
    tl.store(out_ptr + row, tl.minimum(count, vocab - 1).to(tl.int64))


# One program walks a whole row (three dependent passes over ~0.6 MB at a 152k vocabulary), so a row costs
# about 0.1 ms whatever the batch; torch's cumsum costs in proportion to the batch. Measured on the H200,
# qwen3-0.6b shape, whole replay: batch 64 went 2.74 -> 2.59 ms with the kernel, batch 1 1.21 -> 1.33 ms.
# So small batches keep the torch path; the cut is between those two points, not measured finer.
MIN_ROWS = 32


def available_for(logits: torch.Tensor) -> bool:
    """True where the kernel runs and pays: CUDA tensors of at least MIN_ROWS rows with triton installed
    (CPU tests call draw() under TRITON_INTERPRET=1 directly). Shapes only: the choice is fixed per graph."""
    return triton is not None and logits.is_cuda and logits.shape[0] >= MIN_ROWS


def draw(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor, greedy_below: float,
         block: int = _BLOCK) -> torch.Tensor:
    """logits [B, V] (any float dtype, last dim contiguous), temperature [B] float32, u [B] float32 in [0, 1)
    -> [B] int64 draws from softmax(logits / T). `block` (a power of two) is the tile: tests shrink it.

    temperature may be strided: the decode step passes a column of its packed [B, width] rows
    (DecodeLayout.sampling_inputs). The kernel reads it contiguous, so it gets a contiguous copy: that also
    gives every caller the same Triton specialisation (the column starts 12 bytes into a row, a fresh tensor
    on a 16-byte boundary), so a prefill step sampling >= MIN_ROWS rows does not compile another variant in
    service (the likely cause of the compile `bench-engine` logged at batch 64, whose second run finds every
    prompt cached and samples all 64 in one prefill step)."""
    assert logits.stride(-1) == 1, "logits: the vocabulary dimension must be contiguous"
    rows, vocab = logits.shape
    assert temperature.shape == (rows,) and u.shape == (rows,)
    temperature, u = temperature.contiguous(), u.contiguous()
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    _inverse_cdf_kernel[(rows,)](logits, logits.stride(0), temperature, u, out, vocab, greedy_below,
                                 BLOCK=min(block, triton.next_power_of_2(vocab)), num_warps=8)
    return out
