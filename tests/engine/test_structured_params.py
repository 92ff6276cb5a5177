"""StructuredOutputs at the edge (the request's constraint, checked when made) and the tool-call parsers."""

import json

import pytest

from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import SamplingParams
from ostinato.server.tool_calls import ToolRequest
from ostinato.server.tool_parsers import Llama3JsonParser, QwenToolParser, parser_for_template
from ostinato.structured_outputs import StructuredOutputs, from_request, from_response_format


def test_one_constraint_exactly():
    with pytest.raises(InvalidRequestError, match="exactly one") as e:
        StructuredOutputs(regex="a+", choice=("a",))
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="got none"):
        StructuredOutputs()


def test_invalid_schema_names_the_field_and_where():
    with pytest.raises(InvalidRequestError, match="properties/x") as e:
        StructuredOutputs(json={"type": "object", "properties": {"x": {"type": "no-such-type"}}})
    assert e.value.param == "structured_outputs.json"
    with pytest.raises(InvalidRequestError, match="not valid JSON") as e:
        from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": "{nope"}})
    assert e.value.param == "response_format"


def test_equal_schemas_share_a_key():
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}})
    b = StructuredOutputs(json=json.dumps({"properties": {"b": {"type": "string"}, "a": {"type": "integer"}},
                                           "type": "object"}))
    assert a.key == b.key and a == b


def test_sampling_params_takes_vllm_dict_and_checks_it():
    p = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert p.structured_outputs.choice == ("yes", "no")
    with pytest.raises(InvalidRequestError, match="unknown field") as e:
        SamplingParams(structured_outputs={"jsn": {}})
    assert e.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError, match="non-empty list") as e:
        SamplingParams(structured_outputs={"choice": "yes"})
    assert e.value.param == "structured_outputs.choice"
    assert SamplingParams().replace(structured_outputs={"regex": "a"}).structured_outputs.regex == "a"


def test_response_format_kinds():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}).kind == "json_object"
    spec = from_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}})
    assert spec.kind == "json" and spec.schema == {"type": "object"}
    with pytest.raises(InvalidRequestError, match="'text', 'json_object' or 'json_schema'"):
        from_response_format({"type": "xml"})
    assert from_request(None) is None


def test_qwen_parser_reads_calls_and_keeps_the_rest():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = QwenToolParser().parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                                    ("get_time", {})]
    content, calls = QwenToolParser().parse("<tool_call>{not json}</tool_call>")
    assert calls == [] and content == "<tool_call>{not json}</tool_call>"


def test_llama3_parser():
    content, calls = Llama3JsonParser().parse('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; '
                                              '{"name": "g", "parameters": {}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert Llama3JsonParser().parse("Hello {there}") == ("Hello {there}", [])
    assert isinstance(parser_for_template("{{ '<|python_tag|>' }}"), Llama3JsonParser)
    assert isinstance(parser_for_template("<tool_call>"), QwenToolParser)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time"}}]


def test_tool_choice_constraints_and_results():
    assert ToolRequest.of(TOOLS, "none", None) is None
    auto = ToolRequest.of(TOOLS, None, None)
    assert auto.choice == "auto" and auto.constraint() is None
    named = ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None)
    assert named.constraint().schema == TOOLS[0]["function"]["parameters"]
    content, calls = named.tool_calls('{"city": "Rome"}')
    assert content is None and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}
    required = ToolRequest.of(TOOLS, "required", None)
    items = required.constraint().schema["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["get_time"]]
    _, calls = required.tool_calls('[{"name": "get_time", "parameters": {}}]')
    assert [c.name for c in calls] == ["get_time"]
    with pytest.raises(InvalidRequestError, match="not among the tools") as e:
        ToolRequest.of(TOOLS, {"type": "function", "function": {"name": "nope"}}, None)
    assert e.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError, match="needs a non-empty 'name'"):
        ToolRequest.of([{"type": "function", "function": {}}], "auto", None)


def test_logprobs_a_mask_ruled_out_stay_valid_json():
    from ostinato.engine.outputs import CompletionOutput, TokenLogprob
    from ostinato.server.streaming import ChoiceCursor, Formatter

    class Tok:
        def decode(self, ids):
            return f"t{ids[0]}"

    c = CompletionOutput(0, "t1", [1], "stop", [TokenLogprob(1, 0.0, [(1, 0.0), (2, float("-inf"))])])
    fmt = Formatter(Tok())
    assert json.loads(json.dumps(fmt.chat_logprobs(c).model_dump(), allow_nan=False))
    lp = fmt.completion_logprobs(c, ChoiceCursor())
    assert lp.top_logprobs == [{"t1": 0.0, "t2": -9999.0}]
