"""SamplingParams: what a request asks of the sampler. Pure Python, validated at creation."""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass

from ostinato.errors import InvalidRequestError

# Temperatures below this are greedy: dividing logits by ~0 overflows float32. The one greedy rule: the
# sampler (host and device) and SamplingParams.greedy all compare against it. vLLM uses the same cut-off.
GREEDY_TEMPERATURE = 1e-5


def is_greedy(temperature: float) -> bool:
    return temperature < GREEDY_TEMPERATURE


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request holds (as vLLM's SamplingParams.output_kind).

    CUMULATIVE: everything generated so far, every step (each output copies the whole completion: O(length)).
    DELTA: only what is new since the request's previous output; merge_deltas (engine/outputs.py) joins them.
    FINAL_ONLY: one output, when the request finishes, holding everything. LLM.generate always uses this.
    """

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


def _as_float32(x: float) -> float:
    """x as the sampler sees it: a float32 (inf when x overflows float32)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)  # True is an int to Python, not to a user


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (names and meanings follow vLLM / OpenAI).

    temperature 0 (anything below GREEDY_TEMPERATURE) means greedy. top_k <= 0 (or -1) disables top-k;
    top_p == 1 disables top-p.
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

        # NaN compares false with everything, so finiteness is checked first; the sampler works in float32,
        # where a tiny top_p becomes 0 and a huge temperature inf: both would give garbage tokens.
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"temperature must be a finite number >= 0 (0 means greedy), "
                      f"got {self.temperature!r}")
        if not math.isfinite(_as_float32(self.temperature)):
            raise bad("temperature", f"temperature {self.temperature!r} overflows float32; use a value below 1e38")
        if not _is_real(self.top_p) or not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"top_p must be a finite number in (0, 1], got {self.top_p!r}")
        if _as_float32(self.top_p) == 0.0:
            raise bad("top_p", f"top_p {self.top_p!r} rounds to 0 in float32; use a value >= 1e-38")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise bad("seed", f"seed must be an integer, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")
        if not _is_int(self.n) or self.n < 1:
            raise bad("n", f"n must be an integer >= 1, got {self.n!r}")
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise bad("stop", "stop strings must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "stop_token_ids must be non-negative integers")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise bad("output_kind", f"output_kind must be a RequestOutputKind, got {self.output_kind!r}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)
