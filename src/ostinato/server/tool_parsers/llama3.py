"""Llama 3.1 JSON tool calls: the message is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `;`."""

from __future__ import annotations

import json

from ostinato.server.tool_parsers.base import ToolCall, call_from_json

_TAG = "<|python_tag|>"


class Llama3JsonParser:
    name = "llama3_json"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):].strip()
        if not body.startswith("{"):
            return (text.strip() or None), []
        decoder, calls, pos = json.JSONDecoder(), [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return (text.strip() or None), []  # not (only) calls: the whole text is content
            call = call_from_json(obj, "parameters")
            if call is None:
                return (text.strip() or None), []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls

    def format_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
