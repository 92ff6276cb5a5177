"""A conversation rendered by the model's chat template, as the prompt text and its token ids.

One place for LLM.chat, `ostinato chat` and the server's /v1/chat/completions, so that all send exactly what
the template writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from ostinato.errors import InvalidRequestError


# A role is a name ("system", "user", "assistant", "tool", ...). Templates print it as it is, so an empty role,
# or one holding markup (a newline, "<|im_end|>"), would make a turn the template never meant.
ROLE_PATTERN = r"^[A-Za-z][A-Za-z0-9_-]{0,63}$"


def role_problem(role: Any) -> str | None:
    """What is wrong with a message's role, or None for a valid one."""
    if isinstance(role, str) and re.fullmatch(ROLE_PATTERN, role):
        return None
    return (f"role must be a name such as 'system', 'user' or 'assistant' (a letter, then up to 63 letters, "
            f"digits, '_' or '-'), got {role!r}")


def render_chat(tokenizer, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[int]]:
    """(prompt text, token ids) for one conversation: a list of {"role": ..., "content": ...} messages."""
    if not messages:
        raise InvalidRequestError("a conversation needs at least one message", param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise InvalidRequestError(f"message {i} must be a dict with 'role' and 'content', got {m!r}",
                                      param="messages")
        problem = role_problem(m["role"])
        if problem is not None:
            raise InvalidRequestError(f"message {i}: {problem}", param="messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template (tokenizer_config.json); pass chat_template=... "
                                  "or send a plain prompt (generate() offline, /v1/completions on the server)",
                                  param="messages")
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message, **dict(chat_template_kwargs or {}))
    except Exception as e:  # jinja2 errors raised by the template itself (e.g. "roles must alternate")
        raise InvalidRequestError(f"the chat template rejected the messages: {e}", param="messages") from e
    # The template writes any BOS token itself: encoding must not add another.
    return text, tokenizer.encode(text, add_special_tokens=False)
