"""Incremental detokenization and stop strings. Pure Python plus the HF tokenizer object (no torch).

Streaming text one token at a time has two traps:
- a multi-byte UTF-8 character (é, 漢, 🎉) may be split across tokens; decoding the first piece alone
  gives U+FFFD. The text of a token is therefore held until the bytes it ends with form whole characters.
- decoders are not concatenative (SentencePiece strips the first token's leading space, byte-level
  merges bytes): the new text of a token is found by decoding a short window that ends with it and
  subtracting the decoded window without it (vLLM's prefix/read offsets; tokenizers' `DecodeStream`).
Both keep the cost per token independent of the output length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import tokenizers
from packaging.version import Version

logger = logging.getLogger(__name__)

try:  # tokenizers >= 0.21.1 has a correct DecodeStream (0.21.0's dropped text in some cases).
    from tokenizers.decoders import DecodeStream

    _HAS_DECODE_STREAM = Version(tokenizers.__version__) >= Version("0.21.1")
except ImportError:  # pragma: no cover - depends on the installed tokenizers
    DecodeStream = None
    _HAS_DECODE_STREAM = False

REPLACEMENT_CHAR = "\ufffd"
# DecodeStream raises this when a longer window no longer decodes to text starting with the shorter one
# (invalid UTF-8 regrouped by lossy decoding; see vllm-project/vllm#17448). Message from tokenizers' Rust.
_INVALID_PREFIX_MSG = "Invalid prefix encountered"
# How many prompt tokens to decode before the output so the first output token gets its context (a
# leading space, the rest of a character). vLLM uses the shortest clean suffix of 4 to 23 tokens.
_MIN_PROMPT_CONTEXT, _MAX_PROMPT_CONTEXT = 4, 24
# Offsets fallback: how far back the decoding window starts (a few tokens give the decoder its context).
_OFFSET_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text, one token at a time.

    `append(token_id)` returns the text that token completed ("" while a character is still incomplete
    or for a skipped special token); `.text` is all output text so far (joined when read: appending never
    copies the text so far). The result equals decoding the
    prompt and the output together and removing the prompt's text, except that a trailing incomplete
    character is never emitted.

    Uses `tokenizers.decoders.DecodeStream` when the tokenizer has a Rust backend; otherwise (slow
    tokenizers) or if DecodeStream reports an inconsistent prefix, it continues with vLLM's
    prefix/read offsets over `tokenizer.decode`, without losing any held token.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._pieces: list[str] = []
        # The Rust tokenizer behind a fast HF tokenizer; None for slow (pure Python) tokenizers.
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        # Context tokens, then every output token: what the offsets fallback decodes windows of.
        context, self._at_boundary = self._prompt_context(prompt_token_ids)
        self._ids: list[int] = list(context)
        self._num_context = len(self._ids)
        # The DecodeStream is made and primed at the first append: decode_all() never needs one.
        self._stream = None
        self._stream_pending = _HAS_DECODE_STREAM and self._backend is not None
        # Text is complete up to this index of _ids (the prompt context counts as emitted).
        self._read_offset = len(self._ids)
        # Window start for the offsets fallback: a few tokens before _read_offset.
        self._prefix_offset = max(0, self._read_offset - _OFFSET_CONTEXT)

    @property
    def at_boundary(self) -> bool:
        """True when no token is held back: the context decodes to whole characters, or the last append
        released text (a byte-level decoder then gives the next token the same text with or without them)."""
        return self._at_boundary

    def _decode(self, ids: Sequence[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            list(ids), skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> tuple[Sequence[int], bool]:
        """The shortest prompt suffix (4..23 tokens) that decodes to whole characters, and whether one did."""
        prompt = list(prompt_token_ids)
        for n in range(_MIN_PROMPT_CONTEXT, min(len(prompt), _MAX_PROMPT_CONTEXT - 1) + 1):
            if REPLACEMENT_CHAR not in self._decode(prompt[-n:]):
                return prompt[-n:], True
        context = prompt[-_MIN_PROMPT_CONTEXT:]  # a longer prompt's 4-token suffix was decoded above, unclean
        return context, len(prompt) < _MIN_PROMPT_CONTEXT and REPLACEMENT_CHAR not in self._decode(context)

    def append(self, token_id: int) -> str:
        """Add one generated token; return the text it completed (possibly "")."""
        if self._stream_pending:
            self._start_stream()
        self._ids.append(token_id)
        new_text = self._stream_step(token_id) if self._stream is not None else self._offsets_step()
        self._at_boundary = bool(new_text)
        if new_text:
            self._pieces.append(new_text)
            return new_text
        return ""

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def _start_stream(self) -> None:
        self._stream_pending = False
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        try:  # prime the stream with the context; the prompt's own text is not output
            for token_id in self._ids:
                stream.step(self._backend, token_id)
        except Exception as e:
            if _INVALID_PREFIX_MSG not in str(e):
                raise
            return  # the offsets take over
        self._stream = stream

    def decode_all(self, token_ids: Sequence[int]) -> str:
        """Append all of `token_ids` to a fresh detokenizer and return their text: what appending them one by
        one returns, joined, usually from one decode of context + output instead of one decode step per token
        (LLM.generate's requests without stop strings need no text before they finish).

        One decode is used only where it cannot differ from the token-by-token text: the context's text is a
        prefix of it and what follows holds no U+FFFD. A trailing incomplete character (which appending never
        releases) or an invalid byte run (which appending may have released as valid text earlier, see
        DecodeStream's "Invalid prefix") ends in or holds U+FFFD, and then the tokens are appended one by one.
        """
        assert len(self._ids) == self._num_context, "decode_all() is for a detokenizer nothing was appended to"
        context = self._ids
        head = self._decode(context)
        whole = self._decode(context + list(token_ids))
        if whole.startswith(head) and REPLACEMENT_CHAR not in whole[len(head):]:
            text = whole[len(head):]
            self._ids = context + list(token_ids)
            self._stream, self._stream_pending = None, False  # later appends (if any) use the offsets
            self._read_offset = len(self._ids)
            self._prefix_offset = max(0, self._read_offset - _OFFSET_CONTEXT)
            if text:
                self._pieces.append(text)
            return text
        return "".join([self.append(token_id) for token_id in token_ids])

    def _stream_step(self, token_id: int) -> str:
        try:
            chunk = self._stream.step(self._backend, token_id)
        except Exception as e:
            if _INVALID_PREFIX_MSG not in str(e):
                raise
            logger.debug("DecodeStream lost its prefix; continuing with prefix/read offsets")
            self._stream = None
            return self._offsets_step()
        if chunk is None:
            return ""
        self._read_offset = len(self._ids)
        self._prefix_offset = max(0, self._read_offset - _OFFSET_CONTEXT)
        return chunk

    def _offsets_step(self) -> str:
        # Decode [prefix, end) and [prefix, read); the difference is the new text, once it does not end
        # in an incomplete character. The window only grows while a character is incomplete.
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the output: keep text[:keep_chars] and finish the sequence."""

    stop_str: str
    keep_chars: int


def find_stop_string(
    text: str, num_new_chars: int, stop: Sequence[str], include_stop_str_in_output: bool = False
) -> StopMatch | None:
    """Look for a stop string that ends inside the last `num_new_chars` characters of `text`.

    Earlier text was checked by earlier calls, so only matches that end in the new characters are new;
    a match may start before them (a stop string spanning tokens). Of several matches, the one that
    completes first wins (it is where a character-by-character stream would have stopped; on a tie the
    longer one). The cut is before the stop string, or after it with include_stop_str_in_output.
    """
    if num_new_chars <= 0 or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, start, stop string)
    for stop_str in stop:
        # Start the search where a match could first end inside the new characters.
        start = text.find(stop_str, max(0, len(text) - num_new_chars - len(stop_str) + 1))
        if start == -1:
            continue
        candidate = (start + len(stop_str), start, stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, stop_str = best
    return StopMatch(stop_str, end if include_stop_str_in_output else start)


class StopChecker:
    """One sequence's stop strings (`SamplingParams.stop`, `include_stop_str_in_output`)."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output

    def check(self, text: str, num_new_chars: int) -> tuple[str, bool]:
        """(text cut at the stop string, True) if one completed in the last num_new_chars characters,
        else (text, False)."""
        match = find_stop_string(text, num_new_chars, self.stop, self.include_stop_str_in_output)
        return (text, False) if match is None else (text[: match.keep_chars], True)

    def releasable(self, text: str, finished: bool = False) -> str:
        """What a streaming client may see now: see `releasable_text`."""
        return releasable_text(text, self.stop, finished)


class OutputText:
    """One sequence's output text as it streams: finds stop strings and releases what a client may see.

    Each `append` costs O(new text + stop strings), never O(text so far). Released text is final: a stop
    string found later never starts inside it, because while the text ended with a prefix of a stop string
    that prefix was held back (see `releasable_text`); so only the held tail is ever searched or cut.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        self.stop = StopChecker(stop, include_stop_str_in_output)
        self.pieces: list[str] = []  # released text, in order
        self._held = ""  # text that may still turn out to be the start of a stop string

    def append(self, new_text: str) -> bool:
        """Add a token's new text; True if it completed a stop string (the text is then cut there and
        everything up to the cut is released)."""
        if not self.stop.stop:  # nothing to look for or hold back (the common case: one check per token)
            if new_text:
                self.pieces.append(new_text)
            return False
        window, hit = self.stop.check(self._held + new_text, len(new_text))
        keep = window if hit else self.stop.releasable(window)
        if keep:
            self.pieces.append(keep)
        self._held = window[len(keep):]
        return hit

    def finish(self) -> None:
        """The sequence ended (EOS, a stop token, length): what was held back can no longer become a stop
        string, so release it."""
        if self._held:
            self.pieces.append(self._held)
            self._held = ""

    @property
    def text(self) -> str:
        """All released text (O(length): read it once, when the sequence finishes)."""
        return "".join(self.pieces)


def releasable_text(text: str, stop: Sequence[str], finished: bool) -> str:
    """The part of `text` a streaming client may see now.

    While the sequence is unfinished, hold back the longest suffix of `text` that is a prefix of some
    stop string: the next tokens may complete the stop string, and then that text must never have been
    sent. Once finished (the caller has cut the text at any stop string) everything is releasable.
    """
    if finished or not stop:
        return text
    held = 0
    for stop_str in stop:
        # Only suffixes longer than what is already held can matter; a full match is not a "prefix".
        for n in range(min(len(stop_str) - 1, len(text)), held, -1):
            if text.endswith(stop_str[:n]):
                held = n
                break
    return text[: len(text) - held]
