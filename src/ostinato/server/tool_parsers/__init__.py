"""Tool-call parsers, one module per model family's format, and the pick of one for a chat template.

Each parser turns a model's text into (content, tool calls): `qwen` reads Qwen2.5 / Qwen3's (and Hermes')
`<tool_call>{json}</tool_call>` blocks, `llama3` Llama 3.1's bare JSON calls. A template that names neither
format (SmolLM2's, which knows no tools) gets the `<tool_call>` format, which the server then describes to the
model in the system prompt (server/tool_calls.py).
"""

from __future__ import annotations

from ostinato.server.tool_parsers.base import ToolCall, ToolParser
from ostinato.server.tool_parsers.llama3 import Llama3JsonParser
from ostinato.server.tool_parsers.qwen import QwenToolParser

__all__ = ["ToolCall", "ToolParser", "QwenToolParser", "Llama3JsonParser", "parser_for_template"]


def parser_for_template(chat_template: str | None) -> ToolParser:
    """The parser of the format the model's chat template writes tool calls in."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return QwenToolParser()
    if "<|python_tag|>" in template or "ipython" in template:
        return Llama3JsonParser()
    return QwenToolParser()
