"""SamplingParams: what a request asks of the sampler. Pure Python, validated at creation."""

from __future__ import annotations

import copy
import enum
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ostinato.errors import InvalidRequestError
from ostinato.structured_outputs import StructuredOutputs, from_request

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


def _check_temperature(t) -> str | None:
    # NaN compares false with everything, so finiteness is checked first; the sampler works in float32,
    # where a tiny top_p becomes 0 and a huge temperature inf: both would give garbage tokens.
    if not _is_real(t) or not math.isfinite(t) or t < 0:
        return f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}"
    if not math.isfinite(_as_float32(t)):
        return f"temperature {t!r} overflows float32; use a value below 1e38"
    return None


def _check_top_p(p) -> str | None:
    if not _is_real(p) or not math.isfinite(p) or not 0.0 < p <= 1.0:
        return f"top_p must be a finite number in (0, 1], got {p!r}"
    if _as_float32(p) == 0.0:
        return f"top_p {p!r} rounds to 0 in float32; use a value >= 1e-38"
    return None


# Seeds are 64-bit, as in vLLM (torch.long) and OpenAI: the sampler keys a row by the seed's low 64 bits, so a
# wider one would silently draw another seed's tokens.
SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1


def _check_seed(seed) -> str | None:
    if seed is None or (_is_int(seed) and SEED_MIN <= seed <= SEED_MAX):
        return None
    return f"seed must be an integer in [-2**63, 2**63 - 1] (64 bits), got {seed!r}"


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

    The logits processors (runner/logits_processors.py), each off at its default, as vLLM defines them:
    repetition_penalty (HF's: a logit of a token seen in the prompt or the output is divided by it when
    positive, multiplied when negative), presence_penalty and frequency_penalty (OpenAI's: over the output,
    minus presence for a token seen, minus frequency times its count), logit_bias (token id -> bias added to
    its logit), min_p (drop tokens less likely than min_p times the most likely), min_tokens (EOS and the stop
    token ids are banned until that many tokens were generated) and bad_words (strings whose token sequences
    are banned: the last token of one is masked when the output ends with the rest of it).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # a dict {token id: bias} is accepted and stored as pairs
    min_p: float = 0.0
    min_tokens: int = 0
    bad_words: tuple[str, ...] = ()
    # Not a sampling setting, but it travels with them to the block manager: mixed into the key of the
    # request's first KV block, so only requests with the same salt share cached prefix blocks (vLLM's
    # cache_salt). The server also puts the API key's namespace here.
    cache_salt: str | None = None
    # A JSON schema, regex, choice or grammar the output must follow (a dict in vLLM's shape is accepted).
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._validate(_CHECKS)

    def _normalize(self) -> None:
        # Accept lists / a single string from callers, store tuples so the object stays hashable-frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items(), key=_bias_key)))
        elif self.logit_bias is None:
            object.__setattr__(self, "logit_bias", ())
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            object.__setattr__(self, "structured_outputs", from_request(self.structured_outputs))

    def _validate(self, names) -> None:
        """Check the named fields (in _CHECKS order: the first bad one is reported)."""
        for name in (n for n in _CHECKS if n in names):
            problem = _CHECKS[name](getattr(self, name))
            if problem is not None:
                raise InvalidRequestError(problem, param=name)
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            # Completion i of a seeded request draws with seed + i (LLMEngine): the last one must fit too.
            raise InvalidRequestError(f"seed {self.seed} with n {self.n}: completion i uses seed + i, which must "
                                      f"stay at most 2**63 - 1; lower the seed", param="seed")
        if self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens ({self.min_tokens}) must be at most max_tokens "
                                      f"({self.max_tokens})", param="min_tokens")

    def replace(self, **changes) -> SamplingParams:
        """A copy with `changes`, checking the changed values only: the others were checked when this object
        was made (dataclasses.replace would build and check every field again)."""
        unknown = set(changes) - set(self.__dataclass_fields__)
        if unknown:
            raise TypeError(f"SamplingParams has no field(s) {sorted(unknown)}")
        new = copy.copy(self)
        for name, value in changes.items():
            object.__setattr__(new, name, value)
        new._normalize()
        new._validate(changes)
        return new

    @property
    def greedy(self) -> bool:
        return is_greedy(self.temperature)

    @property
    def penalized(self) -> bool:
        """Whether a penalty over the tokens seen so far applies (they need per-token counts)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def processes_logits(self) -> bool:
        """Whether any logits processor is on (else the row skips them all)."""
        return self.penalized or bool(self.logit_bias) or self.min_p > 0.0 or self.min_tokens > 0 \
            or bool(self.bad_words)


# What a model's generation_config.json may set as defaults, as vLLM reads it: its names -> SamplingParams'.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                            "repetition_penalty": "repetition_penalty", "min_p": "min_p",
                            "max_new_tokens": "max_tokens"}


def with_defaults(given: Mapping[str, Any], defaults: Mapping[str, Any]) -> SamplingParams:
    """The one place a request meets the model's defaults (EngineConfig.generation_defaults): `given` holds
    only the fields the caller set, and every field it leaves out takes the model's default where the model
    has one, else SamplingParams' own. An explicit value always wins, even one equal to the default."""
    return SamplingParams(**{**defaults, **given})


def _bias_key(item):
    return item[0] if _is_int(item[0]) else -1  # bad keys are reported by the check, not by sorting


# How many entries a request's logit_bias and bad_words may hold: they live in fixed-width device tables.
MAX_LOGIT_BIAS = 300
MAX_BAD_WORDS = 16


def _check_penalty(name: str, low: float, high: float):
    def check(x) -> str | None:
        if _is_real(x) and math.isfinite(x) and low <= x <= high:
            return None
        return f"{name} must be a number in [{low:g}, {high:g}], got {x!r}"
    return check


def _check_repetition_penalty(x) -> str | None:
    if _is_real(x) and math.isfinite(x) and x > 0 and math.isfinite(_as_float32(x)) and _as_float32(x) > 0:
        return None
    return f"repetition_penalty must be a finite number > 0 (1 = off; above 1 discourages repeats), got {x!r}"


def _check_logit_bias(pairs) -> str | None:
    if not isinstance(pairs, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in pairs):
        return f"logit_bias must map token ids to biases, got {pairs!r}"
    if len(pairs) > MAX_LOGIT_BIAS:
        return f"logit_bias holds {len(pairs)} entries; at most {MAX_LOGIT_BIAS} are allowed"
    for token, bias in pairs:
        if not _is_int(token) or token < 0:
            return f"logit_bias keys must be token ids (integers >= 0), got {token!r}"
        if not _is_real(bias) or not math.isfinite(bias) or not -100 <= bias <= 100:
            return f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}"
    return None


def _check_bad_words(words) -> str | None:
    if len(words) > MAX_BAD_WORDS:
        return f"bad_words holds {len(words)} strings; at most {MAX_BAD_WORDS} are allowed"
    if all(isinstance(w, str) and w.strip() for w in words):
        return None
    return "bad_words must be non-empty strings"


# Each checked field's check: the problem with a value (InvalidRequestError's message), or None.
_CHECKS: dict[str, Callable[[Any], str | None]] = {
    "temperature": _check_temperature,
    "top_p": _check_top_p,
    "top_k": lambda k: None if _is_int(k) and (k >= 1 or k in (0, -1)) else
    f"top_k must be -1 or 0 (disabled) or >= 1, got {k!r}",
    "max_tokens": lambda m: None if _is_int(m) and m >= 1 else f"max_tokens must be an integer >= 1, got {m!r}",
    "seed": _check_seed,
    "logprobs": lambda n: None if n is None or (_is_int(n) and 0 <= n <= 20) else
    f"logprobs must be an integer in [0, 20], got {n!r}",
    "n": lambda n: None if _is_int(n) and n >= 1 else f"n must be an integer >= 1, got {n!r}",
    "stop": lambda stop: None if all(isinstance(s, str) and s != "" for s in stop) else
    "stop strings must be non-empty strings",
    "stop_token_ids": lambda ids: None if all(_is_int(t) and t >= 0 for t in ids) else
    "stop_token_ids must be non-negative integers",
    "presence_penalty": _check_penalty("presence_penalty", -2.0, 2.0),
    "frequency_penalty": _check_penalty("frequency_penalty", -2.0, 2.0),
    "repetition_penalty": _check_repetition_penalty,
    "logit_bias": _check_logit_bias,
    "min_p": _check_penalty("min_p", 0.0, 1.0),
    "min_tokens": lambda m: None if _is_int(m) and m >= 0 else f"min_tokens must be an integer >= 0, got {m!r}",
    "bad_words": _check_bad_words,
    "cache_salt": lambda salt: None if salt is None or (isinstance(salt, str) and salt != "") else
    f"cache_salt must be a non-empty string, got {salt!r}",
    "output_kind": lambda kind: None if isinstance(kind, RequestOutputKind) else
    f"output_kind must be a RequestOutputKind, got {kind!r}",
}
