"""Each token's own text, looked up instead of decoded, for tokenizers with a byte-level decoder.

A byte-level decoder (GPT-2's BPE, as Llama 3, Qwen and SmolLM use) maps each token to bytes, joins the bytes
of all tokens and decodes them as UTF-8. So once the text so far ends on a whole character, the next token adds
exactly the text it decodes to alone, if that holds whole characters too: the same text `DecodeStream` would
give, without a decode call. A streamed sequence's step then costs one dict lookup; a token that is only part of
a character (its text alone holds U+FFFD) sends that sequence back to the incremental detokenizer
(engine/detokenizer.py) until its text ends on a whole character again.

Other decoders (SentencePiece's metaspace, WordPiece) change a token's text with its neighbours, so they keep
the incremental detokenizer for every token.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders

from ostinato.engine.detokenizer import REPLACEMENT_CHAR


class TokenTexts(dict):
    """Token id -> its text, or None where the id is only part of a character (or past the tokenizer's
    vocabulary). Filled as ids are first met, one decode each: a 150k-token vocabulary decoded up front costs
    about a second, and a stream meets a small part of it."""

    def __init__(self, backend: Any, skip_special_tokens: bool):
        super().__init__()
        self._backend, self._skip = backend, skip_special_tokens
        self._known = backend.get_vocab_size(with_added_tokens=True)

    def __missing__(self, token_id: int) -> str | None:
        text = None
        if 0 <= token_id < self._known:  # others: the detokenizer decides, as it does without a table
            text = self._backend.decode([token_id], skip_special_tokens=self._skip)
            if REPLACEMENT_CHAR in text:
                text = None
        self[token_id] = text
        return text


def token_texts(tokenizer: Any, skip_special_tokens: bool) -> TokenTexts | None:
    """The tokenizer's TokenTexts; None when its decoder is not byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(getattr(backend, "decoder", None), decoders.ByteLevel):
        return None
    return TokenTexts(backend, skip_special_tokens)


class TokenTextCache:
    """One TokenTexts per skip_special_tokens setting, made the first time a streamed request needs it."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._tables: dict[bool, TokenTexts | None] = {}

    def get(self, skip_special_tokens: bool) -> TokenTexts | None:
        if skip_special_tokens not in self._tables:
            self._tables[skip_special_tokens] = token_texts(self._tokenizer, skip_special_tokens)
        return self._tables[skip_special_tokens]
