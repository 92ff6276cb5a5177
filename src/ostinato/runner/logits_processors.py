"""The logits processors of decode rows, on the device, where sampling draws: penalties, logit_bias, min_p,
min_tokens and bad words (SamplingParams defines each).

State. A row that uses any holds a slot (its SLOT column; FLAGS says which processors are on, 0 when none)
in device tables the decode graph reads, so a row that moves when another leaves takes nothing with it:
- counts [slots + 1, V] int32: per token, how often the sequence generated it, plus PROMPT_BIT when the
  prompt holds it (repetition_penalty counts both, presence and frequency the output only);
- a sparse table [slots + 1, K] of (token, bias, until): logit_bias (until: never ends), and min_tokens'
  bans of EOS and the stop ids (-inf until the row generated min_tokens tokens);
- bad words [slots + 1, NB, L] token sequences, right-aligned (-1: nothing), and each row's last L - 1
  outputs, to match them: a word's last token is banned when the outputs end with the rest of it.
The last slot is the scratch slot: rows without processors (pad rows too) read its empty tables.
`join` writes a slot's tables when its sequence joins the decode batch (from the sequence's tokens); the
step keeps them current itself: the token a row feeds is the one it generated last, so `process_logits`
counts it first (in the graph, before the penalties), and a top-k / top-p row re-drawn after the replay
is counted with its final token.

Order, as vLLM's: bans and logit_bias, then the penalties, then min_p (after temperature, before top-k /
top-p). The penalties and min_p run as one Triton kernel on a GPU (kernels/penalties.py), whose rows
without them read nothing; the sparse table is B x K elements. On CPU a batch without processors skips
everything (a free read of the host rows). The logits are changed in place, so logprobs of a row that
uses processors are of its processed distribution.
"""

from __future__ import annotations

import numpy as np
import torch

from ostinato.contract import LogitsSpec
from ostinato.kernels import penalties as penalties_kernel
from ostinato.runner.inputs import to_device
from ostinato.runner.sampling_state import (CTR, FLAGS, FREQ, HISTORY, MIN_P, MINP, PENALTY, PRES, REP, SLOT,
                                            SPARSE, TEMP)
from ostinato.sampling_params import MAX_BAD_WORDS, MAX_LOGIT_BIAS

PROMPT_BIT = 1 << 30
COUNT_MASK = PROMPT_BIT - 1
BAD_WORD_TOKENS = 8  # MAX_BAD_WORD_TOKENS of engine/logits_spec.py (a word's tokens at most)
SPARSE_WIDTH = MAX_LOGIT_BIAS + 64  # logit_bias entries and min_tokens' bans (at most 64)
BAD_WORD_SEQS = 2 * MAX_BAD_WORDS  # each word as written and with a leading space
_ALWAYS = (1 << 31) - 1  # `until` of an entry that never ends
_COLUMNS = {"SLOT": SLOT, "FLAGS": FLAGS, "TEMP": TEMP, "REP": REP, "PRES": PRES, "FREQ": FREQ, "MIN_P": MIN_P}


def row_flags(spec: LogitsSpec | None) -> int:
    """The FLAGS column of a row: which processors it runs (0 when none)."""
    if spec is None:
        return 0
    p = spec.params
    return ((PENALTY if p.penalized else 0) | (MINP if p.min_p > 0 and not p.greedy else 0)
            | (SPARSE if p.logit_bias or spec.min_tokens_ban or spec.bad_words else 0)
            | (HISTORY if any(len(w) > 1 for w in spec.bad_words) else 0))


def state_bytes(slots: int, vocab: int) -> int:
    """Device bytes the tables of `slots` rows take (the counts dominate)."""
    per_slot = vocab * 4 + SPARSE_WIDTH * 16 + BAD_WORD_SEQS * BAD_WORD_TOKENS * 8 + BAD_WORD_TOKENS * 8
    return (slots + 1) * per_slot


class LogitsProcessors:
    """The tables of `slots` decode rows (plus the scratch slot) for a vocabulary, on `device`."""

    def __init__(self, slots: int, vocab: int, device: torch.device):
        self.scratch, self.vocab, self.device = slots, vocab, device
        n, z = slots + 1, dict(device=device)
        self.counts = torch.zeros(n, vocab, dtype=torch.int32, **z)
        self.bias_ids = torch.zeros(n, SPARSE_WIDTH, dtype=torch.int64, **z)
        self.bias_vals = torch.zeros(n, SPARSE_WIDTH, dtype=torch.float32, **z)
        self.bias_until = torch.zeros(n, SPARSE_WIDTH, dtype=torch.int32, **z)
        self.bad = torch.full((n, BAD_WORD_SEQS, BAD_WORD_TOKENS), -1, dtype=torch.int64, **z)
        self.recent = torch.full((n, BAD_WORD_TOKENS - 1), -1, dtype=torch.int64, **z)
        self._free = list(range(slots - 1, -1, -1))

    # ---- slots: the host side, when rows join and leave ------------------------------------------------
    def join(self, spec: LogitsSpec, history: tuple[int, ...], num_generated: int) -> int:
        """A slot for a joining row, its tables written from the sequence's tokens (history: prompt, then the
        num_generated outputs; empty when the spec needs none). Eager device work, on this row only."""
        slot = self._free.pop()
        p = spec.params
        if p.penalized:
            counts = self.counts[slot]
            counts.zero_()
            split = len(history) - num_generated
            if split > 0:
                counts[to_device(history[:split], torch.int64, self.device)] = PROMPT_BIT
            if num_generated:
                outputs = to_device(history[split:], torch.int64, self.device)
                counts.index_add_(0, outputs, torch.ones_like(outputs, dtype=torch.int32))
        self._write_sparse(slot, spec)
        bad = np.full((BAD_WORD_SEQS, BAD_WORD_TOKENS), -1, dtype=np.int64)
        for i, word in enumerate(spec.bad_words):
            bad[i, BAD_WORD_TOKENS - len(word):] = word
        recent = np.full(BAD_WORD_TOKENS - 1, -1, dtype=np.int64)
        last = list(history[len(history) - num_generated:])[-(BAD_WORD_TOKENS - 1):] if num_generated else []
        if last:
            recent[len(recent) - len(last):] = last
        self.bad[slot].copy_(to_device(bad, torch.int64, self.device))
        self.recent[slot].copy_(to_device(recent, torch.int64, self.device))
        return slot

    def _write_sparse(self, slot: int, spec: LogitsSpec) -> None:
        entries = [(t, b, _ALWAYS) for t, b in spec.params.logit_bias]
        entries += [(t, float("-inf"), spec.params.min_tokens) for t in spec.min_tokens_ban]
        ids = np.zeros(SPARSE_WIDTH, dtype=np.int64)
        vals = np.zeros(SPARSE_WIDTH, dtype=np.float32)
        until = np.zeros(SPARSE_WIDTH, dtype=np.int32)
        for i, (t, b, u) in enumerate(entries):
            ids[i], vals[i], until[i] = t, b, u
        self.bias_ids[slot].copy_(to_device(ids, torch.int64, self.device))
        self.bias_vals[slot].copy_(to_device(vals, torch.float32, self.device))
        self.bias_until[slot].copy_(to_device(until, torch.int32, self.device))

    def leave(self, slot: int) -> None:
        self._free.append(slot)

    def reset(self) -> None:
        self._free = list(range(self.scratch - 1, -1, -1))

    # ---- the step: device work only, capturable ---------------------------------------------------------
    def process_logits(self, logits: torch.Tensor, rows: torch.Tensor, input_ids: torch.Tensor | None = None
                       ) -> None:
        """Apply the rows' processors to logits [B, V] float32, in place; rows: [>= B, width] int32 holding
        their settings. input_ids [B]: the tokens the rows feed (a decode step), counted first; None for a
        prefill draw, whose history the tables hold already."""
        b = logits.shape[0]
        rows = rows[:b]
        flags = rows[:, FLAGS]
        if logits.device.type == "cpu" and not bool(flags.any()):
            return  # eager on CPU: a batch without processors skips them all
        slot = torch.where(flags != 0, rows[:, SLOT].long(), self.scratch)
        if input_ids is not None:
            self._record(input_ids, flags, slot)
        self._apply_sparse(logits, rows, flags, slot)
        if penalties_kernel.available_for(logits):
            penalties_kernel.apply(logits, rows, self.counts, _COLUMNS, {"PENALTY": PENALTY, "MINP": MINP},
                                   COUNT_MASK)
        else:
            apply_dense(logits, rows, self.counts[slot])

    def _record(self, input_ids: torch.Tensor, flags: torch.Tensor, slot: torch.Tensor) -> None:
        """Count each row's fed token (its last output) and shift it into its last outputs."""
        self.counts.index_put_((slot, input_ids), ((flags & PENALTY) != 0).to(torch.int32), accumulate=True)
        recent = self.recent[slot]  # [B, L - 1]
        shifted = torch.cat([recent[:, 1:], input_ids[:, None]], dim=1)
        self.recent[slot] = torch.where(((flags & HISTORY) != 0)[:, None], shifted, recent)

    def _apply_sparse(self, logits: torch.Tensor, rows: torch.Tensor, flags: torch.Tensor,
                      slot: torch.Tensor) -> None:
        b = logits.shape[0]
        line = torch.arange(b, device=logits.device)[:, None]
        active = self.bias_until[slot] > rows[:, CTR, None]  # the scratch slot's `until` is 0: never
        logits.index_put_((line.expand(b, SPARSE_WIDTH), self.bias_ids[slot]),
                          torch.where(active, self.bias_vals[slot], 0.0), accumulate=True)
        bad = self.bad[slot]  # [B, NB, L]
        prefix, last = bad[:, :, :-1], bad[:, :, -1]
        ends_with = ((prefix == -1) | (prefix == self.recent[slot][:, None, :])).all(dim=-1) & (last >= 0)
        logits.index_put_((line.expand(b, BAD_WORD_SEQS), last.clamp(min=0)),
                          torch.where(ends_with, float("-inf"), 0.0), accumulate=True)


def apply_dense(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> None:
    """The penalties and min_p in torch (kernels/penalties.py's reference), in place; counts [B, V]: the rows'
    own. Rows without them keep their logits bit for bit (a select, not arithmetic)."""
    floats = rows.view(torch.float32) if rows.is_contiguous() else rows.contiguous().view(torch.float32)
    flags = rows[:, FLAGS]
    rep, pres, freq = floats[:, REP, None], floats[:, PRES, None], floats[:, FREQ, None]
    n = (counts & COUNT_MASK).to(torch.float32)
    y = torch.where(counts != 0, torch.where(logits > 0, logits / rep, logits * rep), logits)
    y = y - freq * n - torch.where(n > 0, pres, 0.0)
    logits.copy_(torch.where(((flags & PENALTY) != 0)[:, None], y, logits))
    t, min_p = floats[:, TEMP, None], floats[:, MIN_P, None]
    threshold = logits.amax(dim=-1, keepdim=True) + t * torch.log(min_p.clamp(min=1e-30))
    logits.masked_fill_(((flags & MINP) != 0)[:, None] & (logits < threshold), float("-inf"))

