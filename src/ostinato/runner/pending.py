"""A launched step's tokens on their way to the host: PendingStep (the decode rows', then those of the prefill
chunks that sampled in the same step: ChunkSamples), read once by result(), possibly after the next step was
launched (overlapped scheduling)."""

from __future__ import annotations

import torch

from ostinato.contract import SampledToken, StepResult
from ostinato.runner.sampler import HostCopy, SampledTokens, SamplerOutput


class PendingStep:
    """A launched step; result() waits for its tokens (once) and returns them: the decode rows', then those of
    the prefill chunks that sampled in the same step (`then`)."""

    def __init__(self, done: StepResult | None = None, seq_ids: list[int] | None = None,
                 sampled: SamplerOutput | None = None, host: torch.Tensor | None = None, event=None):
        self._done, self._seq_ids, self._sampled, self._host, self._event = done, seq_ids, sampled, host, event
        self._then: StepResult | None = None

    def then(self, chunks: "ChunkSamples | None") -> None:
        """Append the tokens the step's prefill chunks sampled (read with the decode rows' in result())."""
        self._then = chunks

    @property
    def seq_ids(self) -> list[int]:
        ids = self._done.seq_ids if self._done is not None else self._seq_ids
        return ids + self._then.seq_ids if self._then is not None else ids

    def result(self) -> StepResult:
        if self._done is None:
            if self._sampled is not None:
                self._done = _result(self._seq_ids, self._sampled)
            else:
                self._event.synchronize()
                self._done = plain_result(self._seq_ids, self._host.tolist())
        if self._then is not None:  # after the decode rows' (also when those were read early: profiling)
            self._done, self._then = _concat(self._done, self._then.result()), None
        return self._done


class ChunkSamples:
    """The tokens a step's prefill chunks sampled, on their way to the host (HostCopy)."""

    def __init__(self, seq_ids: list[int], copy: HostCopy):
        self.seq_ids, self._copy = seq_ids, copy

    def result(self) -> StepResult:
        return from_host(self.seq_ids, self._copy.get())


def _concat(a: StepResult, b: StepResult) -> StepResult:
    return StepResult(a.seq_ids + b.seq_ids, a.token_ids + b.token_ids, a.tokens + b.tokens)


def plain_result(seq_ids: list[int], token_ids: list[int]) -> StepResult:
    return StepResult(seq_ids, token_ids, list(map(SampledToken, token_ids)))


def _result(seq_ids: list[int], sampled: SamplerOutput) -> StepResult:
    return from_host(seq_ids, sampled.to_host())  # the step's one host sync


def from_host(seq_ids: list[int], host: SampledTokens) -> StepResult:
    if host.logprobs is None:
        return plain_result(seq_ids, host.token_ids)
    return StepResult(seq_ids, host.token_ids, [
        SampledToken(token_id=host.token_ids[i], logprob=host.logprobs[i],
                     top=None if host.top_ids is None else list(zip(host.top_ids[i], host.top_logprobs[i])))
        for i in range(len(seq_ids))
    ])
