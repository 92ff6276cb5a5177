"""Streamed answers: server-sent events written per engine step, as cheaply as the event loop allows.

With 64 streams the server writes one chunk per stream per decode step (some 20k chunks a second), all
on one event loop, so the per-chunk work is what bounds the server. Measured on the 2-core development machine:
a pydantic model per chunk cost ~13 us, json-encoding a chunk dict ~7 us, an `asyncio.timeout` around each send
~7 us, against ~0.3 us for a chunk written from a template with only its text json-encoded, and ~0.3 us for the
send watchdog below. Starlette's StreamingResponse adds an anyio task group per response and two generator
layers per chunk; the response here is a plain ASGI callable.

Each chunk is exactly what the pydantic response models would write (tests/engine/test_outputs_delta.py compares).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Callable

from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ostinato.engine.async_engine import EngineDeadError, RequestStream
from ostinato.engine.outputs import CompletionOutput
from ostinato.server.protocol import (ChatChunkChoice, ChatCompletionChunk, ChatLogprobs, ChatTokenLogprob,
                                      CompletionLogprobs, CompletionResponse, DeltaMessage, ErrorInfo, ErrorResponse,
                                      PromptTokensDetails, TopLogprob, UsageInfo)

logger = logging.getLogger(__name__)

# One encoder for every chunk (json.dumps with options builds a new one per call); compact, as pydantic writes.
_encode_json = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _string_or_null(value: str | None) -> str:
    """A chunk's optional string field as JSON. None is written here: the encoder takes its slow path for
    anything but a string (~10x a short string's cost), and nearly every chunk has no finish_reason."""
    return "null" if value is None else _encode_json(value)


class ChoiceCursor:
    """One completion of a stream: tokens sent so far (for usage) and the character offset of the next token
    (completions logprobs' text_offset)."""

    def __init__(self) -> None:
        self.num_tokens = 0
        self.text_offset = 0


class Formatter:
    """Turns engine outputs into OpenAI logprob shapes (needs the tokenizer for token strings)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion_logprobs(self, c: CompletionOutput, cursor: ChoiceCursor) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for entry in c.logprobs or []:
            text = self.token_str(entry.token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(_finite(entry.logprob))
            lp.top_logprobs.append({self.token_str(t): _finite(v) for t, v in entry.top})
            lp.text_offset.append(cursor.text_offset)
            cursor.text_offset += len(text)
        return lp

    def chat_logprobs(self, c: CompletionOutput) -> ChatLogprobs:
        content = []
        for entry in c.logprobs or []:
            text = self.token_str(entry.token_id)
            top = [TopLogprob(token=(s := self.token_str(t)), logprob=_finite(v), bytes=list(s.encode()))
                   for t, v in entry.top]
            content.append(ChatTokenLogprob(token=text, logprob=_finite(entry.logprob), bytes=list(text.encode()),
                                            top_logprobs=top))
        return ChatLogprobs(content=content)


# A token a grammar mask ruled out has logprob -inf, which JSON cannot carry; OpenAI and vLLM send -9999.0.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def usage_of(prompt: int, completion: int, cached: int | None) -> UsageInfo:
    """The usage; cached None leaves prompt_tokens_details out (--no-report-cached-tokens)."""
    details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json()}\n\n"


def stream_error(exc: EngineDeadError) -> str:
    return sse(ErrorResponse(error=ErrorInfo(message=str(exc), type="service_unavailable", code=503)))


class ChunkWriter:
    """Writes a stream's chunks from a template: every chunk of a stream shares its envelope (id, object,
    created, model, then its one choice, then "usage": null), taken once from the pydantic model, so the fields
    and their order are the model's."""

    def __init__(self, empty_chunk: BaseModel):
        envelope = _encode_json(empty_chunk.model_dump())  # {"id":..,"model":..,"choices":[],"usage":null}
        head, sep, tail = envelope.partition('"choices":[]')
        assert sep, envelope
        self._head, self._tail = f"data: {head}\"choices\":[", f"]{tail}\n\n"

    def event(self, choice: str) -> str:
        """The chunk of one choice (a JSON object), as OpenAI and vLLM stream n > 1: one choice per chunk."""
        return self._head + choice + self._tail


def _completion_choice(fmt: Formatter, want_logprobs: bool) -> Callable[[CompletionOutput, ChoiceCursor], str]:
    def choice(c: CompletionOutput, cursor: ChoiceCursor) -> str:  # CompletionChoice's fields, in its order
        lp = _encode_json(fmt.completion_logprobs(c, cursor).model_dump()) if want_logprobs else "null"
        return (f'{{"index":{c.index},"text":{_encode_json(c.text)},"logprobs":{lp},'
                f'"finish_reason":{_string_or_null(c.finish_reason)}}}')

    return choice


def _chat_choice(fmt: Formatter, want_logprobs: bool) -> Callable[[CompletionOutput, ChoiceCursor], str]:
    def choice(c: CompletionOutput, cursor: ChoiceCursor) -> str:  # ChatChunkChoice's fields, in its order
        lp = _encode_json(fmt.chat_logprobs(c).model_dump()) if want_logprobs else "null"
        return (f'{{"index":{c.index},"delta":{{"role":null,"content":{_string_or_null(c.text or None)}}},'
                f'"logprobs":{lp},"finish_reason":{_string_or_null(c.finish_reason)}}}')

    return choice


async def choice_events(stream: AsyncIterator, writer: ChunkWriter, make_choice, make_chunk, include_usage: bool,
                        opening: tuple[str, ...] = (), report_cached: bool = True) -> AsyncIterator[str]:
    """The SSE body shared by completions and chat: `opening` events, then for every (merged) DELTA output one
    chunk per completion that advanced, written together; then the usage chunk when asked for, then [DONE].
    make_choice(completion, cursor) writes a choice's JSON; make_chunk(choices, usage) the usage chunk."""
    for event in opening:
        yield event
    cursors: dict[int, ChoiceCursor] = {}
    prompt_len = cached = 0
    try:
        async for out in stream:
            prompt_len, cached = len(out.prompt_token_ids), out.num_cached_tokens
            outputs = out.outputs
            if len(outputs) == 1:  # the common case: one completion, one chunk
                c = outputs[0]
                cursor = cursors.get(c.index) or cursors.setdefault(c.index, ChoiceCursor())
                cursor.num_tokens += len(c.token_ids)
                yield writer.event(make_choice(c, cursor))
            elif outputs:
                events = []
                for c in outputs:
                    cursor = cursors.setdefault(c.index, ChoiceCursor())
                    cursor.num_tokens += len(c.token_ids)
                    events.append(writer.event(make_choice(c, cursor)))
                yield "".join(events)
    except EngineDeadError as e:
        yield stream_error(e)
    if include_usage and cursors:
        completion = sum(c.num_tokens for c in cursors.values())
        yield sse(make_chunk([], usage_of(prompt_len, completion, cached if report_cached else None)))
    yield "data: [DONE]\n\n"


def completion_events(stream: AsyncIterator, request_id: str, model: str, fmt: Formatter, want_logprobs: bool,
                      include_usage: bool, report_cached: bool = True) -> AsyncIterator[str]:
    def chunk(choices, usage):
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)

    return choice_events(stream, ChunkWriter(chunk([], None)), _completion_choice(fmt, want_logprobs), chunk,
                         include_usage, report_cached=report_cached)


def chat_events(stream: AsyncIterator, request_id: str, model: str, fmt: Formatter, want_logprobs: bool, n: int,
                include_usage: bool, report_cached: bool = True) -> AsyncIterator[str]:
    def chunk(choices, usage):
        return ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage)

    # OpenAI opens each choice with a chunk carrying the role; clients rely on it.
    opening = tuple(sse(chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], None))
                    for i in range(n))
    return choice_events(stream, ChunkWriter(chunk([], None)), _chat_choice(fmt, want_logprobs), chunk,
                         include_usage, opening, report_cached)


class EngineStreamResponse(StreamingResponse):
    """Streams `events` as server-sent events and aborts its request however the response ends: done, the
    client disconnected, an error, or a client that read nothing for `send_timeout` seconds (backpressure: a
    send waits only while the socket's buffers are full).

    StreamingResponse's headers, with its own __call__: the client's disconnect is watched by one task per
    response, and a stalled send by one timer per `send_timeout` seconds (not an asyncio.timeout per chunk);
    either cancels the streaming.
    """

    def __init__(self, events: AsyncIterator[str], stream: RequestStream, send_timeout: float):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._request_stream, self._send_timeout = stream, send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        sending_since: float | None = None  # loop.time() when the send in progress began
        ended_by: str | None = None  # why the streaming was cancelled: "disconnect" or "stalled"

        def end(why: str) -> None:
            nonlocal ended_by
            if ended_by is None:
                ended_by = why
                task.cancel()

        def check_send() -> None:  # a timer, re-armed for when the send in progress would time out
            nonlocal timer
            now = loop.time()
            if sending_since is not None and now - sending_since >= self._send_timeout:
                end("stalled")
            else:
                due = self._send_timeout if sending_since is None else sending_since + self._send_timeout - now
                timer = loop.call_later(due, check_send)

        async def watch_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            end("disconnect")

        watcher = asyncio.ensure_future(watch_disconnect())
        timer = loop.call_later(self._send_timeout, check_send)
        try:
            sending_since = loop.time()
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            sending_since = None
            async for event in self.body_iterator:
                sending_since = loop.time()
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                sending_since = None
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if ended_by is None or task.uncancel() > 0:
                raise  # (also) cancelled from outside, e.g. the server shutting down: not ours to swallow
            if ended_by == "stalled":  # returning with the response unfinished makes uvicorn close the connection
                logger.warning("aborting stream %s: the client read nothing for %g s",
                               self._request_stream.request_id, self._send_timeout)
        except OSError:  # the socket is gone (ASGI 2.4 servers raise on a send after a disconnect)
            pass
        finally:
            watcher.cancel()
            timer.cancel()
            self._request_stream.close()
