"""Qwen2.5 / Qwen3 (Hermes) tool calls: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.

A call is the text from a `<tool_call>` to the first `</tool_call>` after it; one whose JSON is not a call stays
content, markers and all, as does a `<tool_call>` never closed. Streaming can therefore send everything before a
`<tool_call>` (holding only an end that may become one), and decide each call at its `</tool_call>`.
"""

from __future__ import annotations

import json

from ostinato.server.tool_parsers.base import Piece, ToolCall, call_from_json, partial_marker_len


class QwenToolParser:
    name = "qwen"
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        pieces, _ = self.take(text, 0, finished=True)
        content = "".join(p for p in pieces if isinstance(p, str)).strip()
        return (content or None), [p for p in pieces if isinstance(p, ToolCall)]

    def take(self, text: str, pos: int, finished: bool) -> tuple[list[Piece], int]:
        pieces: list[Piece] = []
        while True:
            start = text.find(self.start, pos)
            if start < 0:  # no call begins here: all content, but an end that may become `<tool_call>`
                upto = len(text) if finished else len(text) - partial_marker_len(text[pos:], self.start)
                return pieces + ([text[pos:upto]] if upto > pos else []), upto
            if start > pos:
                pieces.append(text[pos:start])
            end = text.find(self.end, start + len(self.start))
            if end < 0:  # the call is not complete: held, or content if the answer ended inside it
                return (pieces + [text[start:]], len(text)) if finished else (pieces, start)
            pos = end + len(self.end)
            pieces.append(self._call(text[start + len(self.start):end]) or text[start:pos])

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            return call_from_json(json.loads(body), "arguments")
        except ValueError:
            return None

    def format_call(self, name: str, arguments: dict) -> str:
        """A call as this format writes it (for the tools prompt and for templates without tool support)."""
        return f"{self.start}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{self.end}"
