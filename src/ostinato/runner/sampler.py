"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs. Device work only.

Every row draws one uniform number u from a counter-based hash of (its key, its counter) computed on the
device (`uniform`), and takes the token where u falls in its cumulative distribution (inverse CDF). No
torch.Generator is involved, so the draw can sit inside a CUDA graph, and a row's token depends only on
its own logits, key and counter: a seeded request gets the same tokens alone or among 31 others, and
again after a preemption recomputes it. The key is the request's seed hashed (or, unseeded, the engine
seed and the sequence id); the counter is the number of tokens the sequence generated before.

`sample_rows` (greedy, temperature, seeds) is the draw every step makes, on the settings of the rows
(runner/sampling_state.py): on a GPU as the two Triton kernels of kernels/sampling.py, elsewhere in torch
(`sample_tokens`, their reference). Rows with top-k or top-p need a sort of the vocabulary; a step that has
such rows runs `sample_filtered` eagerly after the replay on the same device tensors and takes its tokens
for those rows. Prefill steps run both eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ostinato.kernels.device import num_sms
from ostinato.contract import ScheduledSeq
from ostinato.runner.inputs import to_device
from ostinato.sampling_params import GREEDY_TEMPERATURE
from ostinato.kernels import sampling as sampling_kernel
from ostinato.runner.sampling_state import (BLOCKS, ROW_COLUMNS, SamplingBatch, filtered_rows, read_settings,
                                            sampling_inputs, write_settings)

_MASK64 = (1 << 64) - 1
_UNIFORM_BITS = 24  # u = top 24 bits / 2**24: exact in float32, in [0, 1)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def row_key(seed: int | None, engine_seed: int, seq_id: int) -> int:
    """A row's 64-bit sampling key (as a signed int64): from the request's seed, else engine seed + seq id."""
    if seed is not None:
        return _signed(_splitmix64(seed & _MASK64))
    return _signed(_splitmix64(_splitmix64(engine_seed & _MASK64) ^ _splitmix64(seq_id & _MASK64)))


def draw_seed(seed: int, num_generated: int) -> int:
    """Host reference of the device hash: the 64 bits a seeded request draws for its token number
    `num_generated` (0-based). `uniform` computes the same on the device (tests compare them)."""
    return _splitmix64((_splitmix64(seed & _MASK64) ^ num_generated) & _MASK64)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def uniform(key: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[B] int64 key and counter -> [B] float32 in [0, 1): splitmix64(key ^ counter), top 24 bits.
    int64 arithmetic wraps on overflow, which is what the hash wants. Capturable."""
    x = (key ^ counter) + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _MIX1
    x = (x ^ _lsr(x, 27)) * _MIX2
    x = x ^ _lsr(x, 31)
    return _lsr(x, 64 - _UNIFORM_BITS).to(torch.float32) * (1.0 / (1 << _UNIFORM_BITS))


@dataclass(frozen=True)
class SampledTokens:
    """A step's samples on the host as plain lists, one entry per row.

    Logprobs are of the model's raw distribution (before temperature, top-k, top-p). They are None when
    no row asked; rows that did not ask still get a sampled-token logprob and an empty top list.
    """

    token_ids: list[int]
    logprobs: list[float] | None  # the sampled token's logprob per row
    top_ids: list[list[int]] | None  # per row, that request's top-N token ids, most likely first
    top_logprobs: list[list[float]] | None  # per row, their logprobs


@dataclass(frozen=True)
class SamplerOutput:
    """A step's samples, still on the device. Call `to_host()` once to read them."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, the sampled tokens' logprobs
    top_ids: torch.Tensor | None  # [B, N] int64, N = max logprobs asked in the batch (None if N == 0)
    top_logprobs: torch.Tensor | None  # [B, N] float32, sorted descending
    num_logprobs: tuple[int | None, ...]  # per row, what each request asked for

    def to_host(self) -> SampledTokens:
        """Move everything to the host with one device-to-host transfer (one sync)."""
        return self.to_host_async().get()

    def to_host_async(self) -> HostCopy:
        """Start the one device-to-host transfer without waiting for it (into pinned memory on a GPU);
        HostCopy.get() waits for it and reads the lists. float64 holds every token id (< 2**53) and every
        float32 logprob exactly: one tensor, one copy."""
        if self.logprobs is None:
            return HostCopy(self.token_ids, None, self.num_logprobs)
        columns = [self.token_ids[:, None].double(), self.logprobs[:, None].double()]
        if self.top_ids is not None:
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        width = self.top_ids.shape[1] if self.top_ids is not None else 0
        return HostCopy(torch.cat(columns, dim=1), width, self.num_logprobs)  # [B, 2 + 2N]


class HostCopy:
    """A SamplerOutput on its way to the host: the copy is queued on the current stream at construction;
    get() waits for it (the sync) and returns the SampledTokens. width: top-N columns; None when the rows
    carry token ids only."""

    def __init__(self, packed: torch.Tensor, width: int | None, num_logprobs: tuple[int | None, ...]):
        self._width, self._num_logprobs, self._event = width, num_logprobs, None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = packed

    def get(self) -> SampledTokens:
        if self._event is not None:
            self._event.synchronize()
        rows = self._host.tolist()
        if self._width is None:
            return SampledTokens(rows, None, None, None)
        token_ids = [int(row[0]) for row in rows]
        logprobs = [row[1] for row in rows]
        if self._width == 0:
            return SampledTokens(token_ids, logprobs, None, None)
        top_ids, top_logprobs = [], []
        for row, n in zip(rows, self._num_logprobs):
            n = n or 0  # each row gets the top-N its request asked for
            top_ids.append([int(i) for i in row[2 : 2 + n]])
            top_logprobs.append(row[2 + self._width : 2 + self._width + n])
        return SampledTokens(token_ids, logprobs, top_ids, top_logprobs)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index where u * total mass falls in each row's cumulative sum: a draw from the (unnormalized) probs.
    right=True skips zero-probability entries; a rounding past the end clamps to the last index."""
    cdf = probs.cumsum_(dim=-1)  # [B, V], in place
    target = u[:, None] * cdf[:, -1:]  # [B, 1]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor,
                  counter: torch.Tensor) -> torch.Tensor:
    """Greedy rows (temperature 0) take the argmax; the others draw from softmax(logits / T). [B] int64.
    No host sync, no data-dependent shape: capturable. The torch path, reference of the two Triton kernels
    of kernels/sampling.py (sample_rows picks between them)."""
    greedy_ids = logits.argmax(dim=-1)
    is_greedy = temperature < GREEDY_TEMPERATURE
    # One float32 [B, V] buffer, worked in place.
    probs = logits.to(torch.float32, copy=True)  # never the caller's logits: they are the step's output
    probs.div_(torch.where(is_greedy, 1.0, temperature)[:, None])
    probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()  # [B, V] unnormalized
    sampled_ids = _inverse_cdf(probs, uniform(key, counter))
    return torch.where(is_greedy, greedy_ids, sampled_ids)


def sample_rows(logits: torch.Tensor, rows: torch.Tensor, out: torch.Tensor, batch_invariant: bool = False) -> None:
    """sample_tokens on the settings of rows [>= B, >= BLOCKS] int32 (runner/sampling_state.py) into out [B]:
    on a GPU the sampling kernels read the int32 columns as they are, elsewhere the torch path. Decode (in the
    graph and in a mixed step) and prefill steps all draw through here. Capturable. batch_invariant
    (--batch-invariant): the kernels' chunks as for one row, so a row draws the same token in any batch."""
    if sampling_kernel.available_for(logits):
        sampling_kernel.sample(logits, rows, ROW_COLUMNS, out, GREEDY_TEMPERATURE, num_sms(logits.device),
                               batch_invariant=batch_invariant)
        return
    s = sampling_inputs(rows[: logits.shape[0]])
    out.copy_(sample_tokens(logits, s["temperature"], s["key"], s["counter"]))


def _tempered(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [B, V] in float32 divided by each row's temperature (greedy rows left as they are), the greedy
    rows [B] bool)."""
    is_greedy = batch.temperature < GREEDY_TEMPERATURE
    return logits.float() / torch.where(is_greedy, 1.0, batch.temperature)[:, None], is_greedy


def sample_filtered(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Like sample_tokens, after masking each row to its top-k and top-p: a sort of the vocabulary. [B]."""
    scaled, _ = _tempered(logits, batch)
    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [B, V] each
    sorted_logits = mask_sorted(sorted_logits, batch.top_k, batch.top_p)
    probs = (sorted_logits - sorted_logits[:, :1]).exp_()
    picked = _inverse_cdf(probs, uniform(batch.key, batch.counter))  # [B] index into the sorted order
    return sorted_ids.gather(1, picked[:, None]).squeeze(1)


def mask_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit (sorted descending per row) outside the row's top-k, then its top-p nucleus.

    top-k keeps the tokens whose logit is >= the k-th largest (tokens tied with it are kept too).
    top-p keeps the smallest set of most likely tokens whose probability (after top-k) reaches p; the
    most likely token always stays. Rows with k = 0 and p = 1 are left as they are.
    """
    vocab = sorted_logits.shape[-1]
    neg_inf = float("-inf")
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]
    kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1]
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
    sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V] mass of the more likely tokens
    # A token goes once the tokens ranked above it already reach p. Rows with p = 1 are exempt: rounding
    # can push the cumulative sum past 1 and would otherwise drop their tail.
    p = top_p[:, None]  # [B, 1]
    return sorted_logits.masked_fill((mass_above >= p) & (p < 1.0), neg_inf)


def distribution(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """[B, V] float32: the distribution each row draws its token from (what sample_tokens and sample_filtered
    draw by inverse CDF): softmax(logits / T) within the row's top-k and top-p, one-hot at the argmax on
    greedy rows. Speculative decoding's rejection sampling compares the draft's and the model's."""
    scaled, is_greedy = _tempered(logits, batch)
    if batch.any_filtered:
        sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)
        scaled = torch.empty_like(scaled).scatter_(1, sorted_ids, mask_sorted(sorted_logits, batch.top_k,
                                                                              batch.top_p))
    one_hot = torch.zeros_like(scaled).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(is_greedy[:, None], one_hot, scaled.softmax(dim=-1))


def draw_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] int64: the token where each row's u falls in its (unnormalized) distribution probs [B, V], which is
    left as is."""
    return _inverse_cdf(probs.clone(), u)


def finish_sampling(logits: torch.Tensor, tokens: torch.Tensor, batch: SamplingBatch,
                    adjust: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
    """After sample_tokens: top-k / top-p rows re-drawn when the batch has any, then `adjust` (speculative
    decoding's rejection sampling replaces the tokens of the positions a draft model proposed for), logprobs
    when asked."""
    if batch.any_filtered:
        filtered = (batch.top_k > 0) | (batch.top_p < 1.0)
        tokens = torch.where(filtered, sample_filtered(logits, batch), tokens)
    if adjust is not None:
        tokens = adjust(tokens)
    logprobs = top_ids = top_logprobs = None
    if batch.max_num_logprobs is not None:
        # Logprobs of the model's own distribution, as vLLM returns by default.
        all_logprobs = logits.float().log_softmax(dim=-1)  # [B, V]
        logprobs = all_logprobs.gather(1, tokens[:, None]).squeeze(1)  # [B]
        if batch.max_num_logprobs > 0:
            n = min(batch.max_num_logprobs, logits.shape[1])
            top_logprobs, top_ids = all_logprobs.topk(n, dim=-1)  # [B, N], sorted descending
    return SamplerOutput(tokens, logprobs, top_ids, top_logprobs, batch.num_logprobs or ())


class Sampler:
    """Eager sampling of a prefill step's rows. `seed` keys the rows whose request has no seed."""

    def __init__(self, device: torch.device | str, seed: int, batch_invariant: bool = False):
        self.device = torch.device(device)
        self.seed = seed
        self.batch_invariant = batch_invariant  # --batch-invariant: draws independent of the batch (sample_rows)

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> SamplingBatch:
        """Rows of the sequences' settings as a decode row holds them (write_settings), counting their next
        draw, read back on the device (one host-to-device copy). For prefill-shaped batches whose sequences
        hold no decode row (start-up warm-up, tests); a step's sequences are sampled from their rows."""
        assert seqs, "a step samples at least one sequence"
        rows = np.zeros((len(seqs), BLOCKS), dtype=np.int32)
        for row, seq in zip(rows, seqs):
            p = seq.sampling_params
            write_settings(row, p, row_key(p.seed, self.seed, seq.seq_id), seq.num_generated)
        return read_settings(to_device(rows, torch.int32, self.device),
                             [seq.sampling_params.logprobs for seq in seqs], bool(filtered_rows(rows).any()))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch,
                 adjust: Callable[[torch.Tensor], torch.Tensor] | None = None) -> SamplerOutput:
        """Sample from logits [B, V] (any float dtype). Device work only. adjust: finish_sampling's."""
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (tuple(logits.shape), batch.num_rows)
        tokens = torch.empty(batch.num_rows, dtype=torch.int64, device=logits.device)
        sample_rows(logits, batch.rows, tokens, self.batch_invariant)
        return finish_sampling(logits, tokens, batch, adjust)
