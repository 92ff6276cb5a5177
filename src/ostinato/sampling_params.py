"""SamplingParams: what a request asks of the sampler. Pure Python, validated at creation."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .errors import InvalidRequestError


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (as vLLM's SamplingParams.output_kind).

    CUMULATIVE: everything generated so far, every step (each output copies the whole completion: O(length)).
    DELTA: only what is new since the request's previous output; a stream joins them (RequestOutput.add).
    FINAL_ONLY: one output, when the request finishes, holding everything. LLM.generate always uses this.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (names and meanings follow vLLM / OpenAI).

    temperature == 0 means greedy. top_k <= 0 (or -1) disables top-k; top_p == 1 disables top-p.
    seed makes the request's random draws reproducible whatever else shares its batch.
    logprobs=N returns the sampled token's logprob and the top-N alternatives per generated token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    n: int = 1
    # Keep the stop string in the returned text (OpenAI does not; vLLM's default is False too).
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        # Accept lists / a single string from callers, store tuples so the object stays hashable-frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg, param=param)

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"n must be an integer >= 1, got {self.n}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
