"""Streamed chat with `tools`, driven by scripted engine outputs (no model): with tool_choice "auto" content
streams step by step, only what may be a call is held (a partial `<tool_call>` marker, a call until its end, a
Llama 3.1 answer that begins like a call), and the assembled stream equals the non-streamed answer, for both
parser families; "required" holds the whole output. The official `openai` client's stream assembly reads it."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("starlette")

from ostinato.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402
from ostinato.server.app import _chat_choice  # noqa: E402  (the non-streamed answer of a choice)
from ostinato.server.tool_calls import ToolRequest  # noqa: E402
from ostinato.server.tool_stream import tool_chat_events  # noqa: E402

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
QWEN, LLAMA = "{{ '<tool_call>' }}", "{{ '<|python_tag|>' }}"  # templates that pick each parser


def _call(name="get_weather", **args) -> str:
    return json.dumps({"name": name, "arguments": args})


QWEN_TEXTS = [
    "The weather in Paris is sunny today, around 24 degrees, with a light wind from the west.",
    "Use <tool_ kit> wisely; a <tool_call> tag alone is not a call.",
    f"Let me check.\n<tool_call>\n{_call(city='Paris')}\n</tool_call>",
    f"  Two calls:\n<tool_call>{_call(city='Paris')}</tool_call>\n<tool_call>{_call(city='Rome')}</tool_call>\n"
    "and some text after them.  ",
    "<tool_call>{not json}</tool_call> stays content, then <tool_call>" + _call(city="Oslo") + "</tool_call>",
    "An unclosed call <tool_call>" + _call(city="Paris")[:20],
    "Ends on a partial marker <tool_c",
    f"<tool_call>{_call(city='Paris')}</tool_call>",
]
LLAMA_TEXTS = [
    "It is sunny in Paris today, around 24 degrees, with a light wind from the west.",
    json.dumps({"name": "get_weather", "parameters": {"city": "Paris"}}),
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
    '{"name": "get_weather", "parameters": {"city": "Rome"}}',
    '  {"answer": 42}',
    '{"name": "get_weather", "parameters": {"city": "Paris"}} and then some text',
    "<|python_tag|> print('hello')",
    "<b>bold</b> is not the tag",
]


def _chunked(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


def _stream_events(template: str, deltas: list[str], tool_choice="auto", finish_reason="stop"):
    """[(step, chunk)]: each chunk the stream sent, with the step whose output it followed (the last step is
    len(deltas) - 1, the one that finishes the choice)."""
    steps = [[CompletionOutput(0, d, [7], finish_reason if i == len(deltas) - 1 else None)]
             for i, d in enumerate(deltas)]
    return _run(ToolRequest.of([WEATHER], tool_choice, template), steps)


def _run(tools, steps: list[list[CompletionOutput]], n=1, include_usage=False, report_cached=True):
    """[(step, chunk)] of the stream of scripted engine outputs, one RequestOutput per step."""
    step = {"now": -1}

    async def outputs():
        for i, completions in enumerate(steps):
            step["now"] = i
            yield RequestOutput("r", None, [1, 2, 3], completions, i == len(steps) - 1, 0.0, num_cached_tokens=2)

    async def collect():
        return [(step["now"], json.loads(e[len("data: "):])) async for e in
                tool_chat_events(outputs(), "r", "m", tools, n, include_usage, report_cached)
                if e.startswith("data: {")]

    return asyncio.run(collect())


def _assembled(chunks) -> dict:
    """The message a client assembles from the deltas: content joined, calls by index, the finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            for call in choice["delta"].get("tool_calls") or []:
                assert call["index"] not in calls, "a call is sent whole, in one delta"
                calls[call["index"]] = call["function"]
            finish = choice["finish_reason"] or finish
    return {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)] or None, "finish": finish}


def _non_streamed(template: str, text: str, tool_choice="auto") -> dict:
    choice = _chat_choice(CompletionOutput(0, text, [], "stop"), ToolRequest.of([WEATHER], tool_choice, template),
                          None)
    calls = [c["function"] for c in choice.message.tool_calls or []]
    return {"content": choice.message.content, "tool_calls": calls or None, "finish": choice.finish_reason}


def _content_steps(events) -> list[int]:
    return [step for step, chunk in events if any(c["delta"].get("content") for c in chunk["choices"])]


@pytest.mark.parametrize("size", [1, 3, 8, 1000])
@pytest.mark.parametrize("template, text", [pytest.param(QWEN, t, id=f"qwen{i}") for i, t in enumerate(QWEN_TEXTS)]
                         + [pytest.param(LLAMA, t, id=f"llama{i}") for i, t in enumerate(LLAMA_TEXTS)])
def test_the_assembled_stream_is_the_non_streamed_answer(template, text, size):
    events = _stream_events(template, _chunked(text, size))
    assert _assembled(chunk for _, chunk in events) == _non_streamed(template, text)


@pytest.mark.parametrize("template", [pytest.param(QWEN, id="qwen"), pytest.param(LLAMA, id="llama")])
def test_a_plain_answer_streams_in_several_chunks_before_the_choice_ends(template):
    deltas = _chunked(QWEN_TEXTS[0], 6)
    steps = _content_steps(_stream_events(template, deltas))
    assert len([s for s in steps if s < len(deltas) - 1]) >= len(deltas) - 3, steps  # all but what is held


def test_a_partial_marker_is_held_then_sent_as_content():
    events = _stream_events(QWEN, ["Use <tool_", " kit> wisely"])
    first = [c["choices"][0]["delta"]["content"] for s, c in events if s == 0 and c["choices"][0]["delta"]["content"]]
    assert first == ["Use"]  # "Use" streams; " <tool_" may still become a call: held
    assert _assembled(c for _, c in events)["content"] == "Use <tool_ kit> wisely"


def test_content_then_a_call_sends_content_deltas_then_one_tool_calls_delta():
    text = QWEN_TEXTS[2]
    deltas = _chunked(text, 5)
    events = _stream_events(QWEN, deltas)
    kinds = [("calls" if d.get("tool_calls") else "content" if d.get("content") else "other", s)
             for s, c in events for d in [c["choices"][0]["delta"]]]
    call_at = [s for kind, s in kinds if kind == "calls"]
    assert len(call_at) == 1 and call_at[0] == len(deltas) - 1  # sent once its </tool_call> came
    assert [s for kind, s in kinds if kind == "content"][0] < 3  # "Let me check." streamed at once
    assert kinds.index(("calls", call_at[0])) > max(i for i, (k, _) in enumerate(kinds) if k == "content")
    deltas_sent = [c["choices"][0]["delta"] for _, c in events]
    call = next(d["tool_calls"][0] for d in deltas_sent if d.get("tool_calls"))
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert events[-1][1]["choices"][0]["finish_reason"] == "tool_calls"


def test_a_call_is_sent_when_its_end_marker_comes_not_at_the_choice_end():
    call = f"<tool_call>{_call(city='Paris')}</tool_call>"
    events = _stream_events(QWEN, ["Checking. ", call, " More text", " to come."])
    assert [s for s, c in events if c["choices"][0]["delta"].get("tool_calls")] == [1]
    assert 2 in _content_steps(events)  # text after the call streams too


def test_llama3_holds_an_answer_that_begins_like_a_call_and_streams_one_that_does_not():
    deltas = _chunked('{"answer": 42, "note": "a JSON answer, not a call"}', 4)
    assert _content_steps(_stream_events(LLAMA, deltas)) == [len(deltas) - 1]
    deltas = _chunked("<|python_tag|> print('hello') and more", 4)
    assert _content_steps(_stream_events(LLAMA, deltas))[0] < 5  # after the tag, not JSON: content


def test_required_holds_the_output_until_it_finishes():
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}}])
    deltas = _chunked(text, 4)
    events = _stream_events(QWEN, deltas, tool_choice="required")
    assert {s for s, c in events if c["choices"]} == {-1, len(deltas) - 1}  # the role chunk, then all at the end
    assert _assembled(c for _, c in events) == _non_streamed(QWEN, text, "required")


def test_the_openai_clients_stream_assembly_reads_content_then_calls():
    openai_streaming = pytest.importorskip("openai.lib.streaming.chat")
    from openai.types.chat import ChatCompletionChunk

    state = openai_streaming.ChatCompletionStreamState()
    for _, chunk in _stream_events(QWEN, _chunked(QWEN_TEXTS[3], 7)):
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    choice = state.get_final_completion().choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == _non_streamed(QWEN, QWEN_TEXTS[3])["content"] == \
        "Two calls:\n\n\nand some text after them."  # the text between and after the calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_each_of_n_choices_streams_on_its_own():
    texts = [QWEN_TEXTS[3], QWEN_TEXTS[0]]
    parts = [_chunked(t, 5) for t in texts]
    steps = [[CompletionOutput(i, p[k], [7], "stop" if k == len(p) - 1 else None)
              for i, p in enumerate(parts) if k < len(p)] for k in range(max(map(len, parts)))]
    events = _run(ToolRequest.of([WEATHER], "auto", QWEN), steps, n=2)
    for i, text in enumerate(texts):
        mine = [{"choices": [c for c in chunk["choices"] if c["index"] == i]} for _, chunk in events]
        assert _assembled(mine) == _non_streamed(QWEN, text)
    assert [c["index"] for _, chunk in events for d in chunk["choices"] for c in d["delta"].get("tool_calls") or []] \
        == [0, 1]  # each choice numbers its own calls


@pytest.mark.parametrize("report_cached", [True, False])
def test_the_usage_chunk_reports_cached_tokens_only_when_asked(report_cached):
    steps = [[CompletionOutput(0, "Sunny.", [7, 8], "stop")]]
    usage = _run(ToolRequest.of([WEATHER], "auto", QWEN), steps, include_usage=True,
                 report_cached=report_cached)[-1][1]["usage"]
    assert usage["completion_tokens"] == 2 and usage["prompt_tokens"] == 3
    assert usage["prompt_tokens_details"] == ({"cached_tokens": 2} if report_cached else None)
