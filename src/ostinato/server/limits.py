"""What one request may ask of the server, and how long a client may take: the defenses against hostile input.

Every limit is a `serve` flag. The defaults are meant for a public server: no single request may hold the event
loop, the tokenizer or the engine for long, whatever its body says.

- Prompt size: a prompt is refused by its length in characters before it is tokenized (tokenizing 1 MB takes
  seconds), and by its length in tokens after. The character cap defaults to CHARS_PER_TOKEN characters per
  allowed token, far above what real text needs (about 4 for English, 6 for dense code).
- The body: its bytes bound what parsing the JSON costs (which happens on the event loop). The default follows
  from the character cap: the longest prompt, escaped as JSON, plus room for the rest of the request.
- n, stop strings (count and length), stop_token_ids (count) and logprobs: each multiplies per-token work.
- Time: a client must send its request head within --header-timeout seconds and its body within
  --body-timeout; a stream whose client reads nothing for --stream-send-timeout seconds is aborted.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from ostinato.errors import ConfigError, InvalidRequestError

CHARS_PER_TOKEN = 16  # the default character cap: this many characters per allowed prompt token
JSON_BYTES_PER_CHAR = 6  # a character escaped as \uXXXX
BODY_OVERHEAD_BYTES = 1 << 20  # room in a body for everything but the prompt (messages, stop strings, ...)
UNKNOWN_MODEL_LEN_BODY_BYTES = 1 << 20  # the body cap while the model is loading (requests then get 503)


@dataclass(frozen=True)
class ServerLimits:
    """Limits per request and per connection. None for a cap means "derived from max_model_len"."""

    max_prompt_tokens: int | None = None  # default: max_model_len - 1, the model's own limit
    max_prompt_chars: int | None = None  # default: CHARS_PER_TOKEN x the token cap
    max_body_bytes: int | None = None  # default: the character cap as JSON + BODY_OVERHEAD_BYTES
    max_n: int = 16
    max_stop: int = 16  # stop strings per request; also the count of stop_token_ids
    max_stop_len: int = 256  # characters per stop string
    max_logprobs: int = 20
    max_header_bytes: int = 16 * 1024  # request line and headers (server/http.py counts them)
    timeout_keep_alive: float = 5.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    stream_send_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("max_prompt_tokens", "max_prompt_chars", "max_body_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("max_n", "max_stop", "max_stop_len", "max_header_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.max_logprobs <= 20:
            raise ConfigError(f"--max-logprobs must be in [0, 20], got {self.max_logprobs}")
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout", "stream_send_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")

    # ---- caps that follow from the model ----------------------------------------------------------------
    def prompt_tokens(self, max_model_len: int) -> int:
        cap = max_model_len - 1  # a prompt leaves room for at least one generated token
        return cap if self.max_prompt_tokens is None else min(cap, self.max_prompt_tokens)

    def prompt_chars(self, max_model_len: int) -> int:
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN * self.prompt_tokens(max_model_len)

    def body_bytes(self, max_model_len: int | None) -> int:
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        if max_model_len is None:
            return UNKNOWN_MODEL_LEN_BODY_BYTES
        return JSON_BYTES_PER_CHAR * self.prompt_chars(max_model_len) + BODY_OVERHEAD_BYTES

    # ---- checks -------------------------------------------------------------------------------------------
    def check_prompt_chars(self, num_chars: int, max_model_len: int, param: str = "prompt") -> None:
        """Refuse a text prompt by its length in characters, before anything tokenizes it."""
        cap = self.prompt_chars(max_model_len)
        if num_chars > cap:
            raise InvalidRequestError(
                f"the prompt has {num_chars} characters; this server accepts at most {cap} (at most "
                f"{self.prompt_tokens(max_model_len)} tokens): shorten it (or restart the server with a larger "
                "--max-prompt-chars)", param=param)

    def check_prompt_tokens(self, num_tokens: int, max_model_len: int, param: str = "prompt") -> None:
        cap = self.prompt_tokens(max_model_len)
        if num_tokens > cap:
            raise InvalidRequestError(
                f"the prompt has {num_tokens} tokens; this server accepts at most {cap} (max_model_len "
                f"{max_model_len}): shorten it", param=param)

    def check_sampling(self, *, n: int, stop: str | list[str] | None, stop_token_ids: list[int] | None,
                       logprobs: int | None) -> None:
        """Refuse what multiplies per-token work beyond the limits (400, naming the parameter)."""
        if n > self.max_n:
            raise InvalidRequestError(f"n must be at most {self.max_n} on this server, got {n}", param="n")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > self.max_stop:
            raise InvalidRequestError(f"at most {self.max_stop} stop strings are allowed, got {len(stops)}",
                                      param="stop")
        longest = max((len(s) for s in stops), default=0)
        if longest > self.max_stop_len:
            raise InvalidRequestError(f"stop strings may have at most {self.max_stop_len} characters, got one "
                                      f"of {longest}", param="stop")
        if stop_token_ids and len(stop_token_ids) > self.max_stop:
            raise InvalidRequestError(f"at most {self.max_stop} stop_token_ids are allowed, got "
                                      f"{len(stop_token_ids)}", param="stop_token_ids")
        if logprobs is not None and logprobs > self.max_logprobs:
            raise InvalidRequestError(f"logprobs must be at most {self.max_logprobs} on this server, got "
                                      f"{logprobs}", param="logprobs")


_FLAGS = {  # flag: (type, help)
    "max_prompt_tokens": (int, "longest prompt in tokens (default: max_model_len - 1)"),
    "max_prompt_chars": (int, f"longest text prompt in characters, checked before tokenizing (default: "
                              f"{CHARS_PER_TOKEN} x the token cap)"),
    "max_body_bytes": (int, "largest request body; larger ones get HTTP 413 (default: the longest prompt as "
                            "JSON plus 1 MiB)"),
    "max_n": (int, "largest n (completions per request)"),
    "max_stop": (int, "most stop strings (and stop_token_ids) per request"),
    "max_stop_len": (int, "longest stop string in characters"),
    "max_logprobs": (int, "largest logprobs / top_logprobs (vLLM's flag)"),
    "max_header_bytes": (int, "largest request line plus headers; larger ones get HTTP 431"),
    "timeout_keep_alive": (float, "seconds an idle keep-alive connection stays open (uvicorn's flag)"),
    "header_timeout": (float, "seconds a client has to send its request line and headers (slowloris)"),
    "body_timeout": (float, "seconds a client has to send its request body; slower ones get HTTP 408"),
    "stream_send_timeout": (float, "seconds a stream may wait on a client that reads nothing before the "
                                   "request is aborted and its KV blocks freed"),
}


def add_limit_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("limits per request and connection (defaults suit a public server)")
    defaults = ServerLimits()
    for name, (kind, text) in _FLAGS.items():
        default = getattr(defaults, name)
        g.add_argument("--" + name.replace("_", "-"), type=kind, default=default,
                       help=f"{text}" if default is None else f"{text} (default: {default})")


def limits_from(ns: argparse.Namespace) -> ServerLimits:
    """ServerLimits from parsed flags; a ConfigError names the bad flag."""
    return ServerLimits(**{name: getattr(ns, name) for name in _FLAGS})
