"""What every tool-call parser returns: the calls it found, and the text around them."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Protocol, Union


@dataclass(frozen=True)
class ToolCall:
    """One function call: its name and its arguments as JSON text (OpenAI sends arguments as a string)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


# What a parser has decided about a stretch of a choice's text: content (a str) or a whole call.
Piece = Union[str, ToolCall]


class ToolParser(Protocol):
    name: str

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the text outside the calls, or None when it is empty; the calls, in order). Text that only looks
        like a call (malformed JSON, no name) stays content: nothing is dropped."""

    def take(self, text: str, pos: int, finished: bool) -> tuple[list[Piece], int]:
        """Streaming: the pieces of text[pos:] that are decided (content that cannot become part of a call,
        and whole calls), and the offset where the undecided rest begins, to be held until more text comes.
        `text` is the choice's whole text so far; with finished, nothing is held. The content pieces, joined
        and stripped, and the calls are what parse(text) returns."""


def call_from_json(obj, arguments_key: str) -> ToolCall | None:
    """A ToolCall from a decoded {"name": ..., <arguments_key>: {...}} object; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        return ToolCall(obj["name"], args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def partial_marker_len(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is the start of `marker` (but not all of it): the part
    that may still become the marker when more text comes."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
