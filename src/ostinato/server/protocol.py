"""OpenAI-compatible request and response bodies (pydantic v2) for /v1/completions and /v1/chat/completions.

Field names and meanings follow the OpenAI API; `top_k`, `ignore_eos`, `stop_token_ids`, `repetition_penalty`,
`min_p`, `min_tokens` and `bad_words` are vLLM's extensions. Unknown fields are ignored, as OpenAI clients send
extra ones. OpenAI fields that ostinato does not implement (echo, best_of) are accepted only at their
no-op values, so a request never silently gets something other than what it asked for. A sampling field left
out takes the model's default (--generation-config) where it has one.

These models check shapes and types, and what the schema can state (no empty prompt, only text content parts, a role
that is a name, a 64-bit seed); SamplingParams checks the values' ranges and holds the defaults (one message per bad
value, naming its parameter), and the engine what only the model knows (the vocabulary). Types are strict, as the OpenAI
API's are: `"temperature": "0.5"`, `"stream": "yes"`, `"n": true` and `"max_tokens": "3"` are refused (400), not
coerced. Every string must be valid Unicode: a lone UTF-16 surrogate (`"\\ud800"` in JSON) is refused with the field
named, before a tokenizer could choke on it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr,
                      field_validator)

from ostinato.engine.chat_prompt import ROLE_PATTERN, role_problem
from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import SamplingParams, with_defaults
from ostinato.sampling_params import SamplingParams
from ostinato.structured_outputs import StructuredOutputs, from_request, from_response_format


def _valid_unicode(text: str) -> str:
    """Refuse lone surrogates: JSON can carry them, UTF-8 (and so every tokenizer) cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text contains a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start}), "
                         "which is not valid Unicode; send valid UTF-8 text") from None
    return text


def _valid_role(role: str) -> str:
    problem = role_problem(role)
    if problem is not None:
        raise ValueError(problem)
    return role


Text = Annotated[StrictStr, AfterValidator(_valid_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0)]
# The schema says what _check_prompt accepts: no empty prompt, in any of its forms.
NonEmptyText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = (NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds
          | Annotated[list[TokenIds], Field(min_length=1)])
Role = Annotated[StrictStr, AfterValidator(_valid_role), Field(json_schema_extra={"pattern": ROLE_PATTERN})]
_PROMPT_TYPES = "a string, a list of token ids (integers), or a list holding one of those"


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


# The fields a request may leave unset to take the model's default (sampling_params.with_defaults).
_DEFAULTED = ("temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "repetition_penalty",
              "min_p", "min_tokens")


class _SamplingFields(_Lenient):
    """The fields both endpoints share, and their translation to SamplingParams."""

    model: Text | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    # 64 bits, as SamplingParams checks: OpenAPI's int64 says it exactly (FastAPI writes a minimum/maximum as a
    # float, and 2**63 - 1 as a float is 2**63).
    seed: Annotated[StrictInt, Field(json_schema_extra={"format": "int64"})] | None = None
    stop: Text | list[Text] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: list[TokenId] | None = None
    # vLLM's per-request prefix-cache isolation: only requests with the same salt (and API key) share blocks.
    cache_salt: Annotated[Text, Field(min_length=1, max_length=1024)] | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    # OpenAI's form: token ids as JSON object keys (strings), biases in [-100, 100].
    logit_bias: dict[str, StrictFloat] | None = None
    min_p: StrictFloat | None = None
    min_tokens: StrictInt | None = None
    bad_words: list[Text] | None = None
    # OpenAI's response_format, and vLLM's structured_outputs (json, regex, choice, grammar).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None

    def constraint(self) -> StructuredOutputs | None:
        """The output constraint asked for, checked as far as it can be without compiling (a 400 naming it)."""
        fmt, so = from_response_format(self.response_format), from_request(self.structured_outputs)
        if fmt is not None and so is not None:
            raise InvalidRequestError("send response_format or structured_outputs, not both",
                                      param="structured_outputs")
        return fmt or so

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise InvalidRequestError(f"logit_bias keys must be token ids (integers as strings), got {key!r}",
                                          param="logit_bias") from None
            out[token] = bias
        return out

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        defaults: Mapping[str, Any]) -> SamplingParams:
        """SamplingParams for this request; raises InvalidRequestError (HTTP 400) for bad values. A field the
        client left out (or sent as null) takes the model's default (`defaults`, the engine's
        generation_defaults) where it has one, else SamplingParams' own: with_defaults does the merge.
        max_tokens None: the model's default, else SamplingParams'."""
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")
        given = {name: getattr(self, name) for name in _DEFAULTED if getattr(self, name) is not None}
        if self.logit_bias:
            given["logit_bias"] = self._logit_bias()
        if max_tokens is not None:
            given["max_tokens"] = max_tokens
        return with_defaults(dict(given, seed=self.seed, stop=self.stop or (),
                                  stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
                                  logprobs=logprobs, n=self.n, bad_words=tuple(self.bad_words or ()),
                                  structured_outputs=self.constraint()), defaults)

    @property
    def include_usage_chunk(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# ---- requests ----------------------------------------------------------------------------------------------
def _prompt_of_known_type(value: Any) -> str | list:
    """value if it is a prompt of one of the accepted types (strings as valid Unicode); else a ValueError."""
    if isinstance(value, str):
        return _valid_unicode(value)
    if isinstance(value, list):
        if all(type(t) is int for t in value):  # type(): bool is an int subclass, and no token id
            return value
        if all(isinstance(p, str) for p in value):
            return [_valid_unicode(p) for p in value]
        if all(isinstance(p, list) and all(type(t) is int for t in p) for p in value):
            return value
    raise ValueError(f"prompt must be {_PROMPT_TYPES}")


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: StrictInt | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: Text | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _check_prompt(cls, value: Any, _handler) -> str | list:
        # Checked by hand, not by pydantic's union: on a long list of the wrong type the union would build one
        # error per element and alternative, seconds of work on the event loop for one request.
        prompt = _prompt_of_known_type(value)
        if not prompt or (isinstance(prompt, list) and isinstance(prompt[0], (str, list)) and not all(prompt)):
            raise ValueError("the prompt is empty; send at least one token")
        return prompt

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or token ids. Batched prompts are refused (400)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidRequestError(
                    f"got {len(p)} prompts in one request; ostinato takes one prompt per request, send one "
                    "request per prompt (they are batched on the server)", param="prompt")
            p = p[0]
        return p

    def to_sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """max_tokens: the request's, else the model's default, else 16 (OpenAI's)."""
        if self.echo:
            raise InvalidRequestError("echo is not supported by ostinato; leave it false", param="echo")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by ostinato; leave it out", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError("best_of is not supported; leave it out or equal to n", param="best_of")
        defaults = {"max_tokens": 16, **(defaults or {})}
        return self.sampling_params(self.max_tokens, self.logprobs, defaults)


class ContentPart(_Lenient):
    type: Literal["text"]  # ostinato serves text models: the schema lists the one part type it accepts
    text: Text = ""


class ChatMessage(_Lenient):
    role: Role
    # A string, or OpenAI content parts; only {"type": "text"} parts are supported.
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a "tool" turn: the call it answers

    @field_validator("content", mode="wrap")
    @classmethod
    def _check_part_types(cls, value: Any, handler) -> Any:
        # Before the union: a refused part type would otherwise be reported once per alternative (string or
        # parts), and "should be a valid string" first.
        for i, part in enumerate(value if isinstance(value, list) else ()):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content part {i} has type {kind!r}, which is not supported; ostinato serves "
                                 "text models, send only {'type': 'text'} parts")
        return handler(value)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None

    def to_sampling_params(self, prompt_len: int, max_model_len: int,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """max_completion_tokens (OpenAI's current name) or max_tokens; else the model's default capped by the
        rest of the context window, else the rest of the window, as in vLLM."""
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        room = max(1, max_model_len - prompt_len)
        defaults = dict(defaults or {})
        defaults["max_tokens"] = min(defaults.get("max_tokens", room), room)
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, defaults)


# ---- responses ---------------------------------------------------------------------------------------------
def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the prefix cache, not computed


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs shape: parallel lists, one entry per generated token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ToolCallsDelta(DeltaMessage):
    """A streamed chunk's delta that carries tool calls (each with its index, as OpenAI streams them)."""

    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage | ToolCallsDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "ostinato"
    root: str | None = None
    max_model_len: int | None = None  # as vLLM's model card reports it
    quantization: str = "none"  # the weights' scheme (config.quantization_label): none, fp8-compressed-tensors, ...


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def streaming_responses(body: type[BaseModel], chunk: type[BaseModel]) -> dict[int, dict]:
    """The 200 response of an endpoint that streams, for a route's `responses`: `body` as JSON, or with
    "stream": true a text/event-stream of `chunk` objects (as the streaming module writes them)."""
    events = (f'with "stream": true, server-sent events: each `data: <{chunk.__name__} JSON>` (an error '
              'mid-stream is `data: <ErrorResponse JSON>`), then `data: [DONE]`')
    return {200: {"model": body, "description": f"{body.__name__} as JSON; {events}",
                  "content": {"text/event-stream": {"schema": {"type": "string", "description": events}}}}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
