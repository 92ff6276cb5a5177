"""Qwen2.5 / Qwen3 (Hermes) tool calls: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`."""

from __future__ import annotations

import json
import re

from ostinato.server.tool_parsers.base import ToolCall, call_from_json

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


class QwenToolParser:
    name = "qwen"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls, kept, last = [], [], 0
        for match in _CALL.finditer(text):
            try:
                call = call_from_json(json.loads(match.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:
                continue  # not a call: left in the content
            calls.append(call)
            kept.append(text[last:match.start()])
            last = match.end()
        kept.append(text[last:])
        content = "".join(kept).strip()
        return (content or None), calls

    def format_call(self, name: str, arguments: dict) -> str:
        """A call as this format writes it (for the tools prompt and for templates without tool support)."""
        return f"{self.start}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{self.end}"
