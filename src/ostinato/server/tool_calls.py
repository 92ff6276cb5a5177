"""OpenAI `tools` on /v1/chat/completions: the tools into the prompt, `tool_choice` into a constraint, the answer
into `tool_calls`.

- `tool_choice` "none" (or no tools): a plain chat; the tools are not shown to the model.
- "auto" (the default with tools): the model sees the tools and may call them; its text is read by the parser of
  its family's format (server/tool_parsers/), and what does not parse as a call stays content.
- "required", or {"type": "function", "function": {"name": ...}}: the output is constrained by a JSON-schema
  grammar, as vLLM does it, so it always parses: a JSON array of {"name", "parameters"} objects (one of the
  tools each) for "required", the named function's arguments object for a named choice.

Tools reach the model through the chat template (`apply_chat_template(tools=...)`) when the template uses them.
A template that knows no tools (SmolLM2's) gets them as a system message describing the functions and the
`<tool_call>` format instead; its assistant turns that called tools are rendered in that format, and "tool"
messages as their own turns, so a conversation round trip renders whatever the template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ostinato.errors import InvalidRequestError
from ostinato.server.tool_parsers import QwenToolParser, ToolCall, ToolParser, parser_for_template
from ostinato.structured_outputs import StructuredOutputs

_SYSTEM_TOOLS = ("You may call the following functions. To call one, answer with\n{example}\nfor each call, and "
                 "nothing else. The functions, as JSON schemas:\n{tools}")


def _function(tool: Any, i: int) -> dict:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    fn = tool.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise InvalidRequestError(f"tools[{i}].function needs a non-empty 'name'", param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return {**fn, "parameters": params}


def _choice(tool_choice: Any, names: list[str]) -> str | None:
    """"none" | "auto" | "required", or the named function's name."""
    if tool_choice is None:
        return "auto"
    if tool_choice in ("none", "auto", "required"):
        return tool_choice
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                  "'function': {'name': ...}}", param="tool_choice")
    if name not in names:
        raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                                  f"({', '.join(names)})", param="tool_choice")
    return name


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and what tool_choice makes of them."""

    functions: tuple[dict, ...]
    choice: str  # "auto", "required", or a function's name
    parser: ToolParser

    @classmethod
    def of(cls, tools: list | None, tool_choice: Any, chat_template: str | None) -> ToolRequest | None:
        """None when the model is not to call tools (no tools, or tool_choice "none")."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
            return None
        functions = tuple(_function(t, i) for i, t in enumerate(tools))
        choice = _choice(tool_choice, [f["name"] for f in functions])
        if choice == "none":
            return None
        return cls(functions, choice, parser_for_template(chat_template))

    @property
    def named(self) -> dict | None:
        return next((f for f in self.functions if f["name"] == self.choice), None)

    def constraint(self) -> StructuredOutputs | None:
        """The grammar that makes "required" and named choices parse; None for "auto"."""
        if self.choice == "auto":
            return None
        fn = self.named
        if fn is not None:
            return StructuredOutputs(json=fn["parameters"], param="tool_choice")
        calls = [{"type": "object", "properties": {"name": {"enum": [f["name"]]}, "parameters": f["parameters"]},
                  "required": ["name", "parameters"], "additionalProperties": False} for f in self.functions]
        return StructuredOutputs(json={"type": "array", "minItems": 1, "items": {"anyOf": calls}},
                                 param="tool_choice")

    def tool_calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        fn = self.named
        if fn is not None:
            return None, [ToolCall(fn["name"], text.strip())]
        if self.choice == "required":
            try:
                calls = [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False))
                         for c in json.loads(text)]
            except (ValueError, TypeError, KeyError):  # cut short by max_tokens: no call to return
                return text, []
            return None, calls
        return self.parser.parse(text)

    # ---- the prompt ----------------------------------------------------------------------------------
    def template_kwargs(self, chat_template: str | None) -> dict:
        return {"tools": [{"type": "function", "function": f} for f in self.functions]} \
            if template_knows_tools(chat_template) else {}

    def system_message(self) -> dict:
        example = QwenToolParser().format_call("function_name", {"argument": "value"})
        return {"role": "system", "content": _SYSTEM_TOOLS.format(
            example=example, tools="\n".join(json.dumps(f, ensure_ascii=False) for f in self.functions))}


def template_knows_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def template_messages(messages: list, tools: ToolRequest | None, chat_template: str | None) -> list[dict]:
    """The request's messages as the chat template takes them. Assistant tool calls and "tool" messages are
    passed as the template expects them when it knows tools, else written as text turns."""
    knows_tools = template_knows_tools(chat_template)
    out = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            calls = [_message_call(c, i) for i, c in enumerate(m.tool_calls)]
            if knows_tools:
                entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                parser = tools.parser if tools is not None and hasattr(tools.parser, "format_call") \
                    else QwenToolParser()
                text = "\n".join(parser.format_call(c["name"], c["arguments"]) for c in calls)
                entry["content"] = f"{entry['content']}\n{text}".strip()
        if m.tool_call_id is not None and knows_tools:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    if tools is not None and not knows_tools:
        out.insert(0, tools.system_message())
    return out


def _message_call(call: Any, i: int) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"tool_calls[{i}] must be {{'type': 'function', 'function': {{'name', "
                                  "'arguments'}}}}", param="messages")
    args = fn.get("arguments", "{}")
    if isinstance(args, str):  # OpenAI sends a JSON string; templates index into an object
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InvalidRequestError(f"tool_calls[{i}].function.arguments is not valid JSON",
                                      param="messages") from None
    return {"name": fn["name"], "arguments": args}
