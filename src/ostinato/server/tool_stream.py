"""Streamed chat answers of requests with tools.

With `tool_choice` "auto", each choice's text goes through its parser's `take` (server/tool_parsers/) as it
comes: content streams as soon as the parser has decided it cannot be part of a call, and a call is sent whole,
as one `tool_calls` delta with its index, once complete (its end marker, or the choice's end). What is held is
only what may still be a call: for Qwen's `<tool_call>` format, an end of the text that may become the marker
(a partial `<tool_`) and a call from its marker to its `</tool_call>`; for Llama 3.1's JSON format, an answer
that begins with `{` or `<|python_tag|>`, whole, because such an answer is calls only if all of it is (a JSON
object that is not a call is a plain answer), which shows only at its end. An answer in that format that begins
otherwise is content, and streams.

The content deltas, joined, are the non-streamed answer's content: whitespace before the first content is not
sent, and whitespace is held until more content follows it, as the non-streamed content is stripped.
finish_reason is "tool_calls" when the choice called anything.

"required" and a named function hold each choice's text until it finishes: the grammar makes the whole output a
call (a JSON array of calls, or the function's arguments), so there is no content to stream.

The per-step chunks of a plain chat (server/streaming.py) are unchanged.
"""

from __future__ import annotations

from typing import AsyncIterator

from ostinato.engine.async_engine import EngineDeadError
from ostinato.server.protocol import ChatChunkChoice, ChatCompletionChunk, DeltaMessage, ToolCallsDelta
from ostinato.server.streaming import sse, stream_error, usage_of
from ostinato.server.tool_calls import ToolRequest
from ostinato.server.tool_parsers import ToolCall, ToolParser


async def tool_chat_events(stream: AsyncIterator, request_id: str, model: str, tools: ToolRequest, n: int,
                           include_usage: bool, report_cached: bool = True) -> AsyncIterator[str]:
    def chunk(choices, usage=None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    for i in range(n):  # OpenAI opens each choice with a chunk carrying the role
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    choices: dict[int, StreamedChoice | HeldChoice] = {}
    tokens: dict[int, int] = {}
    prompt_len = cached = 0
    try:
        async for out in stream:
            prompt_len, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                choice = choices.get(c.index) or choices.setdefault(c.index, _choice_of(c.index, tools))
                tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
                for event in choice.feed(c.text, c.finish_reason):
                    yield chunk([event])
    except EngineDeadError as e:
        yield stream_error(e)
    if include_usage and tokens:
        yield chunk([], usage_of(prompt_len, sum(tokens.values()), cached if report_cached else None))
    yield "data: [DONE]\n\n"


def _choice_of(index: int, tools: ToolRequest) -> StreamedChoice | HeldChoice:
    return StreamedChoice(index, tools.parser) if tools.choice == "auto" else HeldChoice(index, tools)


class StreamedChoice:
    """One choice of an "auto" request: its content as it is decided, each call when complete."""

    def __init__(self, index: int, parser: ToolParser):
        self.index, self.parser = index, parser
        self.text = ""
        self.decided = 0  # text[:decided] has been taken by the parser
        self.num_calls = 0
        self.content_started = False
        self.held_space = ""  # whitespace after the content sent: sent only if more content follows

    def feed(self, delta: str, finish_reason: str | None) -> list[ChatChunkChoice]:
        """The events for the choice's next text (and its end, when finish_reason is set)."""
        self.text += delta
        pieces, self.decided = self.parser.take(self.text, self.decided, finished=finish_reason is not None)
        events: list[ChatChunkChoice] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                events.append(self._call_event(piece))
            elif content := self._visible(piece):
                if events and not isinstance(events[-1].delta, ToolCallsDelta):
                    events[-1].delta.content += content  # one delta for the content of one step
                else:
                    events.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(content=content)))
        if finish_reason is not None:
            self._finish(events, finish_reason)
        return events

    def _visible(self, content: str) -> str:
        """What of the content to send now: none of the whitespace before the first content, and whitespace at
        its end only once more content follows it."""
        if not self.content_started:
            content = content.lstrip()
        content = self.held_space + content
        shown = content.rstrip()
        self.held_space = content[len(shown):]
        self.content_started = self.content_started or bool(shown)
        return shown

    def _call_event(self, call: ToolCall) -> ChatChunkChoice:
        event = ChatChunkChoice(index=self.index, delta=ToolCallsDelta(tool_calls=[call.to_openai(self.num_calls)]))
        self.num_calls += 1
        return event

    def _finish(self, events: list[ChatChunkChoice], finish_reason: str) -> None:
        """Ends the choice: its finish_reason on this step's last content delta if that is the last event,
        else on an empty delta of its own."""
        finish_reason = "tool_calls" if self.num_calls else finish_reason
        if events and not isinstance(events[-1].delta, ToolCallsDelta):
            events[-1].finish_reason = finish_reason
        else:
            events.append(ChatChunkChoice(index=self.index, delta=DeltaMessage(), finish_reason=finish_reason))


class HeldChoice:
    """One choice of a "required" or named-function request: held whole, then sent as its calls."""

    def __init__(self, index: int, tools: ToolRequest):
        self.index, self.tools = index, tools
        self.parts: list[str] = []

    def feed(self, delta: str, finish_reason: str | None) -> list[ChatChunkChoice]:
        self.parts.append(delta)
        if finish_reason is None:
            return []
        content, calls = self.tools.tool_calls("".join(self.parts))
        if not calls:  # cut short (max_tokens) before the call was complete
            return [ChatChunkChoice(index=self.index, delta=DeltaMessage(content=content),
                                    finish_reason=finish_reason)]
        events = [ChatChunkChoice(index=self.index, delta=ToolCallsDelta(tool_calls=[call.to_openai(i)]))
                  for i, call in enumerate(calls)]
        return events + [ChatChunkChoice(index=self.index, delta=DeltaMessage(), finish_reason="tool_calls")]
