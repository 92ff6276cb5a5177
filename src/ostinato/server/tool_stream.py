"""Streamed chat answers of requests with tools: each choice's text is held until the choice finishes, then sent
as its tool calls (one `tool_calls` delta per call, each with its index, then finish_reason "tool_calls") or, when
it called nothing, as its content.

Holding the text is what makes a call arrive whole: a parser cannot tell a call from content before the call's
end (`auto`), and a client that assembles calls from deltas gets the same result either way. The per-step chunks
of a plain chat (server/streaming.py) are unchanged.
"""

from __future__ import annotations

from typing import AsyncIterator

from ostinato.engine.async_engine import EngineDeadError
from ostinato.server.protocol import ChatChunkChoice, ChatCompletionChunk, DeltaMessage, ToolCallsDelta
from ostinato.server.streaming import sse, stream_error, usage_of
from ostinato.server.tool_calls import ToolRequest


async def tool_chat_events(stream: AsyncIterator, request_id: str, model: str, tools: ToolRequest, n: int,
                           include_usage: bool) -> AsyncIterator[str]:
    def chunk(choices, usage=None) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=choices, usage=usage))

    for i in range(n):  # OpenAI opens each choice with a chunk carrying the role
        yield chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
    texts: dict[int, list[str]] = {}
    tokens: dict[int, int] = {}
    prompt_len = cached = 0
    try:
        async for out in stream:
            prompt_len, cached = len(out.prompt_token_ids), out.num_cached_tokens
            for c in out.outputs:
                texts.setdefault(c.index, []).append(c.text)
                tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
                if c.finish_reason is not None:
                    for event in _finished_choice(c.index, "".join(texts[c.index]), c.finish_reason, tools):
                        yield chunk([event])
    except EngineDeadError as e:
        yield stream_error(e)
    if include_usage and tokens:
        yield chunk([], usage_of(prompt_len, sum(tokens.values()), cached))
    yield "data: [DONE]\n\n"


def _finished_choice(index: int, text: str, finish_reason: str, tools: ToolRequest) -> list[ChatChunkChoice]:
    content, calls = tools.tool_calls(text)
    if not calls:
        return [ChatChunkChoice(index=index, delta=DeltaMessage(content=content), finish_reason=finish_reason)]
    events = []
    if content:
        events.append(ChatChunkChoice(index=index, delta=DeltaMessage(content=content)))
    events += [ChatChunkChoice(index=index, delta=ToolCallsDelta(tool_calls=[call.to_openai(i)]))
               for i, call in enumerate(calls)]
    events.append(ChatChunkChoice(index=index, delta=DeltaMessage(), finish_reason="tool_calls"))
    return events
