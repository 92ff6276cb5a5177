"""A sequence's sampling state: the settings columns of its decode row, the one form they take on the runner.

A row's settings are written once, by `write_settings`, when its sequence joins the persistent decode batch
(runner/decode_batch.py): temperature (float32 bits; 0 on greedy rows), the 64-bit key as two int32 halves,
top-k and top-p (switched off unless the row samples with them), the draw counter, and its logits
processors' flags, slot and settings (runner/logits_processors.py). Everything that samples
reads them back from such rows with `read_settings`: the decode graph from the device rows 0..n-1, a prefill
step from the rows its sequences just joined at, and the sampling kernels (kernels/sampling.py) from the int32
columns themselves (`ROW_COLUMNS`). No other copy of a request's settings exists below SamplingParams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from ostinato.kernels import sampling as sampling_kernel
from ostinato.sampling_params import SamplingParams

# Column layout of a decode row. POS and CTR are adjacent: one slice advances both. The settings are the
# columns before BLOCKS (the block table).
# SLOT to MIN_P are the logits processors' (runner/logits_processors.py): the row's slot in their device
# tables, which of them are on (FLAGS, 0 when none), and the penalties and min_p (float32 bits).
TOKEN, POS, CTR, TEMP, KEY_LO, KEY_HI, TOP_K, TOP_P, SLOT, FLAGS, REP, PRES, FREQ, MIN_P, BLOCKS = range(15)
# FLAGS bits: count penalties (repetition, presence, frequency), min_p, the sparse table (logit_bias,
# min_tokens' bans, bad words), the row's last outputs (multi-token bad words).
PENALTY, MINP, SPARSE, HISTORY = 1, 2, 4, 8
ROW_COLUMNS = sampling_kernel.RowColumns(counter=CTR, temperature=TEMP, key_lo=KEY_LO, key_hi=KEY_HI)
# top_k travels in an int32 column of the row.
MAX_TOP_K = (1 << 31) - 1


@dataclass(frozen=True)
class SamplingBatch:
    """One step's rows to sample (device int32 rows holding their settings), plus host flags that skip unused
    work. The settings as tensors are read from the rows when first asked for: a step whose rows neither
    filter nor sample on the host (greedy and temperature rows on a GPU) never pays for those casts."""

    num_rows: int
    rows: torch.Tensor  # [B, >= BLOCKS] int32
    any_filtered: bool  # some row has top-k or top-p (and samples)
    num_logprobs: tuple[int | None, ...] | None  # per row; None when no row asked
    max_num_logprobs: int | None  # largest N asked for; None when no row wants logprobs

    @cached_property
    def temperature(self) -> torch.Tensor:  # [B] float32; 0 on greedy rows
        return self.rows[:, TEMP].view(torch.float32)

    @cached_property
    def top_k(self) -> torch.Tensor:  # [B] int64; 0 = off
        return self.rows[:, TOP_K].long()

    @cached_property
    def top_p(self) -> torch.Tensor:  # [B] float32; 1.0 = off
        return self.rows[:, TOP_P].view(torch.float32)

    @cached_property
    def key(self) -> torch.Tensor:  # [B] int64
        return (self.rows[:, KEY_HI].long() << 32) | (self.rows[:, KEY_LO].long() & 0xFFFFFFFF)

    @cached_property
    def counter(self) -> torch.Tensor:  # [B] int64: tokens the row generated before this draw
        return self.rows[:, CTR].long()


class RowSettings(NamedTuple):
    """A request's sampling settings as a row carries them: temperature 0 on greedy rows, and top-k / top-p
    switched off (0 / 1.0) unless the row samples and asks for them."""

    temperature: float
    top_k: int
    top_p: float
    filtered: bool  # the row samples with top-k or top-p: it needs the eager finish after a decode replay


def row_settings(p: SamplingParams) -> RowSettings:
    """The one rule for a row's settings (write_settings applies it)."""
    filtered = not p.greedy and (p.top_k > 0 or p.top_p < 1.0)
    return RowSettings(0.0 if p.greedy else float(p.temperature),
                       min(p.top_k, MAX_TOP_K) if filtered and p.top_k > 0 else 0,
                       float(p.top_p) if filtered else 1.0, filtered)


def write_settings(row: np.ndarray, p: SamplingParams, key: int, counter: int, flags: int = 0,
                   slot: int = 0) -> RowSettings:
    """Write a request's settings, its 64-bit key and its draw counter into one int32 row (numpy: a few row
    writes per step cost a microsecond each this way, ten as torch ops). `flags` (logits_processors.row_flags)
    and `slot` place its logits processors. Returns the settings written."""
    settings = row_settings(p)
    floats = row.view(np.float32)
    row[CTR] = counter
    floats[TEMP], row[TOP_K], floats[TOP_P] = settings.temperature, settings.top_k, settings.top_p
    row[KEY_LO], row[KEY_HI] = _int32(key & 0xFFFFFFFF), _int32(key >> 32)
    row[SLOT], row[FLAGS] = slot, flags
    floats[REP], floats[PRES], floats[FREQ], floats[MIN_P] = (p.repetition_penalty, p.presence_penalty,
                                                              p.frequency_penalty, p.min_p)
    return settings


def filters(top_k, top_p):
    """Whether rows sample with top-k or top-p, from their top_k and top_p columns (numpy arrays or scalars):
    write_settings leaves both off on the others."""
    return (top_p < 1.0) | (top_k > 0)


def filtered_rows(rows: np.ndarray) -> np.ndarray:
    """[n] bool: which int32 rows [n, >= BLOCKS] sample with top-k or top-p."""
    return filters(rows[:, TOP_K], rows[:, TOP_P].view(np.float32))


def sampling_inputs(rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """What sample_tokens reads of the rows (temperature, key, counter), from [B, >= BLOCKS] int32."""
    batch = SamplingBatch(rows.shape[0], rows, False, None, None)
    return {"temperature": batch.temperature, "key": batch.key, "counter": batch.counter}


def read_settings(rows: torch.Tensor, num_logprobs: Sequence[int | None] | None, any_filtered: bool
                  ) -> SamplingBatch:
    """The rows [B, >= BLOCKS] int32 (device) to sample, with the host flags the caller keeps for them: each
    row's logprobs request (None when no row asked: then nothing here walks the rows) and whether any row
    filters. No device work here."""
    asked = [k for k in num_logprobs if k is not None] if num_logprobs is not None else []
    return SamplingBatch(num_rows=rows.shape[0], rows=rows, any_filtered=any_filtered,
                         num_logprobs=tuple(num_logprobs) if asked else None,
                         max_num_logprobs=max(asked) if asked else None)


def _int32(x: int) -> int:
    """The int32 with the same low 32 bits as x."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x
