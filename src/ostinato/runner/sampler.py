"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

One `Sampler` per runner. Each step: `batch = sampler.prepare(scheduled_seqs)` (host work and one
host-to-device copy), `out = sampler(logits, batch)` (device work only: no .item(), no boolean indexing,
no shape that depends on tensor values), then `out.to_host()` once, which is the step's only sync.

The sampler runs eagerly after the model (inside or outside a CUDA-graph step): per-request generators
cannot be captured, and sampling is a handful of kernels.

Sampling uses the exponential race: argmax(p / E) with E ~ Exponential(1) i.i.d. picks token i with
probability p_i (P(p_i/E_i is largest) = p_i / sum p). The noise is one [B, V] draw, so a row's draw
depends only on its generator and its own probabilities; that is what makes per-request seeds work.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..engine.request import ScheduledSeq

# Temperatures below this are greedy (dividing logits by ~0 overflows); vLLM uses the same cut-off.
GREEDY_TEMPERATURE = 1e-5
_MASK64 = (1 << 64) - 1
# top_k travels in a float32 tensor with temperature and top_p: exact for integers below 2**24.
_MAX_TOP_K = 1 << 24


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def draw_seed(seed: int, num_generated: int) -> int:
    """The generator seed for a seeded request's token number `num_generated` (0-based).

    Depends only on (seed, num_generated): the same request draws the same noise for its k-th token
    whatever shares its batch, and again after a preemption recomputes it.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ num_generated)


@dataclass(frozen=True)
class SamplingBatch:
    """Per-row sampling settings for one step, built by `Sampler.prepare`.

    The tensors live on the sampler's device; the flags are host values computed from the requests, so
    `Sampler.__call__` skips unused work without reading tensors back.
    """

    num_rows: int
    temperature: torch.Tensor  # [B] float32; 1.0 on greedy rows (their sampled token is discarded)
    is_greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float32; 1.0 = off
    all_greedy: bool
    any_greedy: bool
    any_top_k: bool
    any_top_p: bool
    max_top_k: int  # largest k asked for, 0 when none: top-k alone needs only topk(max_top_k)
    seeded_rows: tuple[tuple[int, torch.Generator], ...]  # (row, generator seeded for this draw)
    num_logprobs: tuple[int | None, ...]  # per row, as the request asked (None = no logprobs)
    max_num_logprobs: int | None  # largest N asked for; None when no row wants logprobs


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
        if self.logprobs is None:
            return SampledTokens(self.token_ids.tolist(), None, None, None)
        # float64 holds every token id (< 2**53) and every float32 logprob exactly: one tensor, one copy.
        columns = [self.token_ids[:, None].double(), self.logprobs[:, None].double()]
        if self.top_ids is not None:
            columns += [self.top_ids.double(), self.top_logprobs.double()]
        rows = torch.cat(columns, dim=1).tolist()  # [B, 2 + 2N]
        width = self.top_ids.shape[1] if self.top_ids is not None else 0
        token_ids = [int(row[0]) for row in rows]
        logprobs = [row[1] for row in rows]
        if self.top_ids is None:
            return SampledTokens(token_ids, logprobs, None, None)
        top_ids, top_logprobs = [], []
        for row, n in zip(rows, self.num_logprobs):
            n = n or 0  # each row gets the top-N its request asked for
            top_ids.append([int(i) for i in row[2 : 2 + n]])
            top_logprobs.append(row[2 + width : 2 + width + n])
        return SampledTokens(token_ids, logprobs, top_ids, top_logprobs)


class Sampler:
    """Samples one token per row from [B, V] logits. `seed` drives the rows without a request seed."""

    def __init__(self, device: torch.device | str, seed: int):
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed & _MASK64)
        # Pinned host memory lets the per-step parameter copy run asynchronously.
        self._pin = self.device.type == "cuda" and torch.cuda.is_available()

    def prepare(self, seqs: Sequence[ScheduledSeq]) -> SamplingBatch:
        """Gather the batch's sampling settings into device tensors and host flags."""
        assert seqs, "a step samples at least one sequence"
        temperature, top_k, top_p, seeded, num_logprobs = [], [], [], [], []
        for row, seq in enumerate(seqs):
            p = seq.sampling_params
            temperature.append(0.0 if p.temperature < GREEDY_TEMPERATURE else float(p.temperature))
            top_k.append(float(min(p.top_k, _MAX_TOP_K)) if p.top_k > 0 else 0.0)
            top_p.append(float(p.top_p))
            num_logprobs.append(p.logprobs)
            if p.seed is not None and temperature[-1] > 0.0:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(draw_seed(p.seed, seq.num_generated))
                seeded.append((row, generator))
        host = torch.tensor([temperature, top_k, top_p], dtype=torch.float32)  # [3, B]
        if self._pin:
            host = host.pin_memory()
        packed = host.to(self.device, non_blocking=self._pin)  # [3, B], the one host-to-device copy
        is_greedy = packed[0] == 0.0
        asked = [n for n in num_logprobs if n is not None]
        greedy_rows = sum(t == 0.0 for t in temperature)
        # top-k / top-p matter only on rows that sample.
        sampling_k = [k for k, t in zip(top_k, temperature) if t > 0.0]
        sampling_p = [p for p, t in zip(top_p, temperature) if t > 0.0]
        return SamplingBatch(
            num_rows=len(seqs),
            temperature=torch.where(is_greedy, 1.0, packed[0]),
            is_greedy=is_greedy,
            top_k=packed[1].to(torch.int64),
            top_p=packed[2],
            all_greedy=greedy_rows == len(seqs),
            any_greedy=greedy_rows > 0,
            any_top_k=any(k > 0 for k in sampling_k),
            any_top_p=any(p < 1.0 for p in sampling_p),
            max_top_k=int(max(sampling_k, default=0)),
            seeded_rows=tuple(seeded),
            num_logprobs=tuple(num_logprobs),
            max_num_logprobs=max(asked) if asked else None,
        )

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """Sample from logits [B, V] (float32; other dtypes are upcast). Device work only."""
        assert logits.dim() == 2 and logits.shape[0] == batch.num_rows, (tuple(logits.shape), batch.num_rows)
        logits = logits.float()  # no copy when already float32
        greedy_ids = logits.argmax(dim=-1) if batch.any_greedy else None  # [B]
        if batch.all_greedy:
            token_ids = greedy_ids
        else:
            sampled_ids = self._sample(logits, batch)  # [B]
            token_ids = torch.where(batch.is_greedy, greedy_ids, sampled_ids) if batch.any_greedy else sampled_ids

        logprobs = top_ids = top_logprobs = None
        if batch.max_num_logprobs is not None:
            # Logprobs of the model's own distribution, as vLLM returns by default.
            all_logprobs = logits.log_softmax(dim=-1)  # [B, V]
            logprobs = all_logprobs.gather(1, token_ids[:, None]).squeeze(1)  # [B]
            if batch.max_num_logprobs > 0:
                n = min(batch.max_num_logprobs, logits.shape[1])
                top_logprobs, top_ids = all_logprobs.topk(n, dim=-1)  # [B, N], sorted descending
        return SamplerOutput(token_ids, logprobs, top_ids, top_logprobs, batch.num_logprobs)

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        scaled = logits / batch.temperature[:, None]  # [B, V]
        if batch.any_top_k or batch.any_top_p:
            scaled = mask_top_k_top_p(scaled, batch)
        probs = scaled.softmax(dim=-1)  # [B, V]
        noise = torch.empty_like(probs)  # [B, V]
        if len(batch.seeded_rows) < batch.num_rows:
            noise.exponential_(generator=self.generator)  # one draw for every unseeded row
        for row, generator in batch.seeded_rows:
            noise[row].exponential_(generator=generator)
        # Exponential noise can round to 0; a 0 divisor would make a masked (p = 0) token NaN and win argmax.
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return probs.div_(noise).argmax(dim=-1)


def mask_top_k_top_p(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus.

    top-k keeps the tokens whose logit is >= the k-th largest (tokens tied with it are kept too).
    top-p keeps the smallest set of most likely tokens whose probability (after top-k) reaches p; the
    most likely token always stays. Rows with k = 0 and p = 1 are left as they are.
    """
    vocab = scaled.shape[-1]
    neg_inf = float("-inf")
    if not batch.any_top_p:
        # top-k alone: the k-th largest of topk(max k) is each row's threshold; no full sort.
        k_max = min(batch.max_top_k, vocab)
        top_values = scaled.topk(k_max, dim=-1).values  # [B, k_max], descending
        kth = top_values.gather(1, (batch.top_k.clamp(1, k_max) - 1)[:, None])  # [B, 1]
        threshold = torch.where(batch.top_k[:, None] > 0, kth, neg_inf)
        return scaled.masked_fill(scaled < threshold, neg_inf)

    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True)  # [B, V] each
    if batch.any_top_k:
        k = torch.where(batch.top_k > 0, batch.top_k.clamp(max=vocab), vocab)  # [B]
        kth = sorted_logits.gather(1, (k - 1)[:, None])  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, neg_inf)
    sorted_probs = sorted_logits.softmax(dim=-1)  # [B, V]
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs  # [B, V] mass of the more likely tokens
    # A token goes once the tokens ranked above it already reach p. Rows with p = 1 are exempt: rounding
    # can push the cumulative sum past 1 and would otherwise drop their tail.
    top_p = batch.top_p[:, None]  # [B, 1]
    outside = (mass_above >= top_p) & (top_p < 1.0)
    sorted_logits = sorted_logits.masked_fill(outside, neg_inf)
    return torch.empty_like(scaled).scatter_(1, sorted_ids, sorted_logits)
