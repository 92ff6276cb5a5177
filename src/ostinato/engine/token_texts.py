"""Each token's own text, looked up instead of decoded, for tokenizers with a byte-level decoder.

A byte-level decoder (GPT-2's BPE, as Llama 3, Qwen and SmolLM use) maps each token to bytes, joins the bytes
of all tokens and decodes them as UTF-8. So once the text so far ends on a whole character, the next token adds
exactly the text it decodes to alone, if that holds whole characters too: the same text `DecodeStream` would
give, without a decode call. A streamed sequence's step then costs one list lookup; a token that is only part of
a character (its text alone holds U+FFFD) sends that sequence back to the incremental detokenizer
(engine/detokenizer.py) until its text ends on a whole character again.

Other decoders (SentencePiece's metaspace, WordPiece) change a token's text with its neighbours, so they keep
the incremental detokenizer for every token.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders

from ostinato.engine.detokenizer import REPLACEMENT_CHAR


def token_texts(tokenizer: Any, skip_special_tokens: bool, vocab_size: int) -> list[str | None] | None:
    """Index a token id to get its text, or None where the id is only part of a character (or past the
    tokenizer's vocabulary); None for the whole table when the tokenizer's decoder is not byte-level."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(getattr(backend, "decoder", None), decoders.ByteLevel):
        return None
    known = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(known)], skip_special_tokens=skip_special_tokens)
    table: list[str | None] = [None if REPLACEMENT_CHAR in t else t for t in texts]
    table.extend([None] * (vocab_size - known))  # ids the model has but the tokenizer lacks: decoded the slow way
    return table


class TokenTextCache:
    """One table per skip_special_tokens setting, built the first time a request needs it (a streamed request;
    LLM.generate's requests decode their text once, at the end, and never build one)."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self._tokenizer, self._vocab_size = tokenizer, vocab_size
        self._tables: dict[bool, list[str | None] | None] = {}

    def get(self, skip_special_tokens: bool) -> list[str | None] | None:
        if skip_special_tokens not in self._tables:
            self._tables[skip_special_tokens] = token_texts(self._tokenizer, skip_special_tokens, self._vocab_size)
        return self._tables[skip_special_tokens]
