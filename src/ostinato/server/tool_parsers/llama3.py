"""Llama 3.1 JSON tool calls: the message is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`), several calls separated by `;`.

The message is calls only when all of it is: an answer that begins with `{` (or the tag) is a call only if
nothing but calls follows, and a bare JSON object that is not a call (`{"answer": 42}`) is content. So streaming
cannot tell such an answer from a call before it ends, and holds it whole; an answer that begins with anything
else is content from its first character, and streams.
"""

from __future__ import annotations

import json

from ostinato.server.tool_parsers.base import Piece, ToolCall, call_from_json

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

    def take(self, text: str, pos: int, finished: bool) -> tuple[list[Piece], int]:
        if pos == 0 and not finished and self._may_be_calls(text):
            return [], 0
        if pos == 0 and finished:
            _, calls = self.parse(text)
            if calls:
                return list(calls), len(text)
        return ([text[pos:]] if len(text) > pos else []), len(text)

    @staticmethod
    def _may_be_calls(text: str) -> bool:
        """Whether the answer so far can still turn out to be calls: it is empty, (the start of) the tag, or
        begins with `{` after the tag or none."""
        head = text.lstrip()
        if _TAG.startswith(head):
            return True
        if head.startswith(_TAG):
            head = head[len(_TAG):].lstrip()
        return not head or head.startswith("{")

    def format_call(self, name: str, arguments: dict) -> str:
        return json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
