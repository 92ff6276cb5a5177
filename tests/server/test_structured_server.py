"""Structured outputs and tools through the server, with the official `openai` client, on the real SmolLM2 model
(CPU, fp32): `chat.completions.parse(response_format=PydanticModel)`, a tools round trip with tool_choice
"required" and a named function, streamed and not, and the 400s for constraints that do not compile."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("xgrammar")
from pydantic import BaseModel, Field  # noqa: E402

from ostinato.engine.engine import LLMEngine  # noqa: E402
from test_server import TestServer, engine_args  # noqa: E402
from test_smollm2 import MODEL, cache_env, report  # noqa: E402,F401  (module fixtures: the converted model)

SERVED = "tiny-llama"  # test_server's served name
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}},
                                                "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server(report):  # noqa: F811
    srv = TestServer(LLMEngine(engine_args(MODEL, max_model_len=1024, num_kv_blocks=256, max_num_seqs=8)))
    yield srv
    srv.stop()


def test_parse_returns_the_pydantic_object(server):
    client = server.client()
    completion = client.chat.completions.parse(
        model=SERVED, messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        response_format=Person, temperature=0.0, max_tokens=40)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)


def test_streamed_json_schema_is_valid_json(server):
    chunks = server.client().chat.completions.create(
        model=SERVED, messages=[{"role": "user", "content": "A person as JSON."}], stream=True, max_tokens=40,
        temperature=0.0, response_format={"type": "json_schema", "json_schema": {
            "name": "person", "schema": Person.model_json_schema()}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    Person.model_validate_json(text)


def _round_trip(server, tool_choice, stream: bool):
    """A call (constrained by tool_choice), the tool's answer fed back as a "tool" message, then the answer."""
    client = server.client()
    kwargs = dict(model=SERVED, tools=[WEATHER, CLOCK], temperature=0.0, max_tokens=48)
    if stream:
        calls, finish = {}, None
        for chunk in client.chat.completions.create(messages=ASK, tool_choice=tool_choice, stream=True, **kwargs):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                calls.setdefault(d.index, d)
            finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
        calls = [calls[i] for i in sorted(calls)]
    else:
        choice = client.chat.completions.create(messages=ASK, tool_choice=tool_choice, **kwargs).choices[0]
        calls, finish = choice.message.tool_calls, choice.finish_reason
    assert finish == "tool_calls" and calls, (finish, calls)
    for call in calls:
        assert call.function.name in ("get_weather", "get_time")
        json.loads(call.function.arguments)  # always parses: the grammar made it
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]}] + [{"role": "tool", "tool_call_id": c.id, "content": "Sunny, 24 C"} for c in calls]
    final = client.chat.completions.create(messages=messages, tool_choice="none", **kwargs).choices[0]
    assert final.finish_reason in ("stop", "length") and final.message.content
    assert not final.message.tool_calls
    return calls


@pytest.mark.parametrize("stream", [False, True])
def test_tools_round_trip_required(server, stream):
    _round_trip(server, "required", stream)


@pytest.mark.parametrize("stream", [False, True])
def test_tools_round_trip_named(server, stream):
    calls = _round_trip(server, {"type": "function", "function": {"name": "get_weather"}}, stream)
    assert [c.function.name for c in calls] == ["get_weather"]
    assert "city" in json.loads(calls[0].function.arguments)


def test_regex_and_choice_through_the_extra_field(server):
    client = server.client()
    out = client.completions.create(model=SERVED, prompt="The code is", max_tokens=12, temperature=0.0,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}})
    import re
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", out.choices[0].text), out.choices[0].text
    out = client.chat.completions.create(model=SERVED, messages=ASK, max_tokens=8, temperature=1.0, seed=3,
                                         extra_body={"structured_outputs": {"choice": ["sunny", "rainy"]}})
    assert out.choices[0].message.content in ("sunny", "rainy")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
])
def test_constraints_that_do_not_compile_are_400_naming_the_field(server, body, param):
    before = server.stats().num_waiting
    r = server.post("/v1/chat/completions", {"model": SERVED, "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert server.stats().num_waiting == before  # refused before it was queued


def test_tools_auto_streamed_is_the_non_streamed_answer(server):
    """tool_choice "auto", greedy: the official client's assembled stream has the non-streamed content and calls
    (the model's own text, whichever it is: a call, an answer, or both); content comes in many deltas."""
    client = server.client()
    kwargs = dict(model=SERVED, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="auto", temperature=0.0,
                  max_tokens=24)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish, content_deltas = "", {}, None, 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        delta = chunk.choices[0].delta if chunk.choices else None
        content += (delta.content or "") if delta else ""
        content_deltas += bool(delta and delta.content)
        for call in (delta.tool_calls or []) if delta else []:
            calls[call.index] = (call.function.name, call.function.arguments)
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert (content or None) == whole.message.content
    assert [calls[i] for i in sorted(calls)] == [(c.function.name, c.function.arguments)
                                                 for c in whole.message.tool_calls or []]
    assert finish == whole.finish_reason
    if whole.message.content and not whole.message.tool_calls:  # SmolLM2 answers in prose here: it streams
        assert content_deltas > 10, content_deltas
