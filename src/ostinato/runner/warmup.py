"""Start-up warm-up of the eager prefill path, so that no kernel compiles inside a user's step.

Why: the decode graphs' warm-up compiles the decode kernels, but prefill (and the chunks of chunked prefill)
runs eagerly, and Triton compiles a new variant of a kernel the first time an integer argument falls in a
new class (equal to 1, divisible by 16, or neither) or a launch picks another constexpr tile: without this the
first 1-token prompt after start-up took 25 times as long as the second. So before
serving, run prefill steps whose shapes cover those classes: one and several sequences, token counts of 1,
odd and multiples of 16, with and without a cached prefix (the chunked-prefill and prefix-cache case), and
both sampling paths (greedy; temperature with top-k/top-p and logprobs). runner/compile_watch.py reports
anything this misses.

Sampling: an eager prefill step samples one row per prompt it finishes, up to max_num_seqs rows, and the
sampling kernels (kernels/sampling.py) pick their vocabulary chunks by row count: the decode graphs'
capture compiled them for the decode rows only, whose rows have other strides than the setting columns a
prefill step samples from (runner/sampling_state.py). So the warm-up also samples one batch of each row count
with a chunk plan of its own, on rows of those columns: without it Triton compiled sampling kernels inside the
first live steps of `ostinato bench throughput`, and that first run lost a fifth of its rate.

Grammar masks: xgrammar's bitmask kernel (runner/structured.py) is specialised on its row count (1, a multiple
of 16, or neither), so a server's first constrained steps at batch 1 and at 16 each compiled it inside a live
step. Where xgrammar is installed, `warm_up_grammar_masks` masks one batch of each class through the same call
(mask_logits) before serving; an engine without xgrammar never imports it.

The steps write their K/V into the scratch block only (every block-table entry is the scratch block, which
the scheduler never hands out: attention/base.py), so no sequence's cache is touched and nothing joins the
decode batch.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import time

import numpy as np
import torch

from ostinato.kernels.device import num_sms
from ostinato.contract import ScheduledSeq, SchedulerOutput
from ostinato.sampling_params import SamplingParams
from ostinato.kernels import sampling as sampling_kernel
from ostinato.runner.inputs import build_prefill_inputs
from ostinato.runner.sampler import sample_rows
from ostinato.runner.sampling_state import BLOCKS, write_settings
from ostinato.runner.structured import mask_logits

logger = logging.getLogger(__name__)

# (new tokens, cached tokens before them) per sequence, one tuple of sequences per warm-up step.
WARMUP_STEPS: tuple[tuple[tuple[int, int], ...], ...] = (
    ((1, 0),),
    ((3, 0),),
    ((16, 0),),
    ((33, 0),),
    ((7, 37),),
    ((32, 48),),
    ((1, 20), (17, 5)),
    ((16, 0), (48, 16), (5, 0)),
    ((16, 496),),  # a context of 512: the split prefill (kernels/prefill_attention.py) compiles here
)
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
_RANDOM = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=1, logprobs=2)
_TEMPERATURE = SamplingParams(temperature=0.8, max_tokens=1)


def warm_up_prefill(model, sampler, block_size: int, scratch_block: int, device: torch.device,
                    max_model_len: int, max_sampled_rows: int = 1) -> tuple[int, float]:
    """Run the warm-up steps that fit max_model_len, then sample prefill-shaped batches of up to
    max_sampled_rows rows (warm_up_sampling) and mask them (warm_up_grammar_masks); returns (forward steps run,
    seconds)."""
    t0 = time.perf_counter()
    ran = 0
    for step_index, shape in enumerate(WARMUP_STEPS):
        if any(new + cached > max_model_len for new, cached in shape):
            continue
        params = _GREEDY if step_index % 2 == 0 else _RANDOM
        seqs = tuple(
            ScheduledSeq(i, tuple(range(3, 3 + new)), cached, (scratch_block,) * math.ceil((new + cached) / block_size),
                         params, 0)
            for i, (new, cached) in enumerate(shape))
        with torch.inference_mode():
            inp = build_prefill_inputs(SchedulerOutput("prefill", seqs), block_size, scratch_block, device)
            hidden = model(inp.input_ids, inp.positions, inp.meta)  # [T, hidden]
            logits = model.compute_logits(hidden[inp.last_token_indices])
            sampler(logits, sampler.prepare(seqs))
        ran += 1
    warm_up_sampling(model.config.vocab_size, max_sampled_rows, device)
    warm_up_grammar_masks(model.config.vocab_size, max_sampled_rows, device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return ran, time.perf_counter() - t0


def warm_up_sampling(vocab: int, max_rows: int, device: torch.device) -> list[int]:
    """Sample one batch of random float32 logits (what compute_logits returns) for each row count up to max_rows
    whose vocabulary chunk plan differs, half of the rows greedy, on setting rows as a prefill step samples from
    (sample_rows). Returns the row counts sampled; none off the GPU, where sampling is torch's and compiles
    nothing."""
    if not sampling_kernel.available_for(torch.empty(0, device=device)):
        return []
    counts = sampling_kernel.plan_representatives(max_rows, vocab, num_sms(device))
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.inference_mode():
        for rows in counts:
            logits = torch.randn(rows, vocab, device=device, generator=gen)
            settings = np.zeros((rows, BLOCKS), dtype=np.int32)
            for i, row in enumerate(settings):
                write_settings(row, _GREEDY if i % 2 == 0 else _TEMPERATURE, key=0, counter=0)
            out = torch.empty(rows, dtype=torch.int64, device=device)
            sample_rows(logits, torch.from_numpy(settings).to(device), out)
    return counts


def bitmask_row_counts(max_rows: int) -> list[int]:
    """One row count per specialisation class of the bitmask kernel's row count, up to max_rows: 1, a count that
    is neither 1 nor a multiple of 16, and 16."""
    return [r for r in (1, 2, 16) if r <= max(1, max_rows)]


def warm_up_grammar_masks(vocab: int, max_rows: int, device: torch.device) -> list[int]:
    """Mask a batch of float32 logits (what the constrained rows' logits are) of each bitmask_row_counts class with
    an all-allowed bitmask, through mask_logits; returns the row counts masked: none off the GPU (xgrammar's CPU
    kernel compiles nothing) or without xgrammar."""
    if device.type != "cuda" or importlib.util.find_spec("xgrammar") is None:
        return []
    import xgrammar as xgr

    counts = bitmask_row_counts(max_rows)
    with torch.inference_mode():
        for rows in counts:
            bitmask = xgr.allocate_token_bitmask(rows, vocab)  # every bit set: no token masked
            mask_logits(torch.zeros(rows, vocab, device=device), list(range(rows)),
                        lambda seq_ids, b=bitmask: (list(range(len(seq_ids))), b))
    logger.info("warmed xgrammar's bitmask kernel for %s rows", counts)
    return counts
