"""Incremental detokenization and stop strings, with real tokenizers built by the `tokenizers` library."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from ostinato.engine.detokenizer import (
    IncrementalDetokenizer,
    StopChecker,
    StopMatch,
    find_stop_string,
    releasable_text,
)

FFFD = "\ufffd"
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Héllo wörld, café crème brûlée!",
    "漢字 and 日本語 text mixed with English.",
    "Party time 🎉🎉 with emoji 🙂 and more 🚀.",
    "The answer is 42.\n\nUser: thanks",
]
MULTIBYTE_TEXT = "café 漢字 🎉 naïve 🚀 end"


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """A GPT-2 / Llama-3 / Qwen style byte-level BPE: every byte is a token, so any text encodes."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|eos|>"]
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    """A Llama-2 / Mistral style SentencePiece BPE: '▁' for spaces, <0xNN> tokens for unknown bytes."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "▁the", "▁fox", "a", "é", "漢", "▁end", "x"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False
    )


class PythonOnlyTokenizer:
    """Looks like a slow (pure Python) HF tokenizer: decode() only, no Rust backend_tokenizer.
    Records every window it decodes, so tests can check the cost per token."""

    def __init__(self, fast: PreTrainedTokenizerFast):
        self.fast = fast
        self.window_lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        self.window_lengths.append(len(ids))
        return self.fast.decode(ids, skip_special_tokens=skip_special_tokens,
                                clean_up_tokenization_spaces=clean_up_tokenization_spaces)


@pytest.fixture(params=["decode_stream", "offsets"])
def make_detok(request, byte_level):
    """Both code paths: tokenizers' DecodeStream, and the prefix/read offsets used for slow tokenizers."""

    def make(prompt_ids, skip_special_tokens=True, tokenizer=None):
        tokenizer = tokenizer or byte_level
        if request.param == "offsets":
            tokenizer = PythonOnlyTokenizer(tokenizer)
        return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)

    return make


def one_token_per_byte(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    """Byte-level ids that split every multi-byte character across tokens (one token per byte)."""
    # The ByteLevel pre-tokenizer maps each byte to one printable character: the byte's token.
    [(mapped, _)] = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    assert len(mapped) == len(text.encode("utf-8"))
    return [tok.convert_tokens_to_ids(c) for c in mapped]


def test_incremental_text_equals_full_decode_for_random_ids(make_detok, byte_level):
    rng = random.Random(0)
    prompt = byte_level.encode("The quick")
    for _ in range(150):
        # Random ids (any bytes, special tokens included), then clean ASCII so nothing is left incomplete.
        ids = [rng.randrange(len(byte_level)) for _ in range(rng.randrange(1, 30))] + byte_level.encode(" end")
        skip = rng.random() < 0.5
        detok = make_detok(prompt, skip_special_tokens=skip)
        pieces = [detok.append(t) for t in ids]
        assert "".join(pieces) == detok.text
        assert detok.text == byte_level.decode(ids, skip_special_tokens=skip)


@pytest.mark.parametrize("tokenizer_name", ["byte_level", "byte_fallback"])
def test_decode_all_equals_appending_one_by_one(request, make_detok, tokenizer_name):
    """LLM.generate's requests without stop strings decode their text once, at the end: it must be exactly the
    text appending token by token gives, also where a character is split across tokens, left incomplete at
    the end, or an invalid byte run makes the decoders disagree."""
    tok = request.getfixturevalue(tokenizer_name)
    rng = random.Random(1)
    prompt = tok.encode("the fox", add_special_tokens=False)
    byte_ids = one_token_per_byte(tok, MULTIBYTE_TEXT) if tokenizer_name == "byte_level" else \
        [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in MULTIBYTE_TEXT.encode()]
    cases = [tok.encode(MULTIBYTE_TEXT, add_special_tokens=False), byte_ids, byte_ids[:-1], byte_ids[:3] + prompt]
    cases += [[rng.randrange(len(tok)) for _ in range(rng.randrange(1, 40))] for _ in range(100)]
    text = " ".join(CORPUS)
    cases += [tok.encode(text[i:i + rng.randrange(1, 60)], add_special_tokens=False) + [tok.eos_token_id] * (i % 2)
              for i in (rng.randrange(len(text)) for _ in range(60))]
    fast = 0
    for ids in cases:
        skip = rng.random() < 0.5
        one_by_one = make_detok(prompt, skip_special_tokens=skip, tokenizer=tok)
        want = "".join(one_by_one.append(t) for t in ids)
        at_once = make_detok(prompt, skip_special_tokens=skip, tokenizer=tok)
        assert at_once.decode_all(ids) == want == at_once.text, (ids, skip)
        fast += at_once._stream is None and not at_once._stream_pending
    if not isinstance(at_once.tokenizer, PythonOnlyTokenizer):  # a started DecodeStream tells the paths apart
        assert len(cases) // 4 < fast < len(cases)  # both ran


@pytest.mark.parametrize("split", ["encoded", "one_token_per_byte"])
def test_multibyte_characters_never_stream_a_replacement_char(make_detok, byte_level, split):
    ids = byte_level.encode(MULTIBYTE_TEXT) if split == "encoded" else one_token_per_byte(byte_level, MULTIBYTE_TEXT)
    detok = make_detok(byte_level.encode("Party"))
    for token_id in ids:
        piece = detok.append(token_id)
        assert FFFD not in piece
        assert MULTIBYTE_TEXT.startswith(detok.text)
    assert detok.text == MULTIBYTE_TEXT


def test_split_emoji_is_held_until_its_last_byte(make_detok, byte_level):
    ids = one_token_per_byte(byte_level, "a🎉")  # 'a', then the four bytes of U+1F389
    detok = make_detok(byte_level.encode("x"))
    assert [detok.append(t) for t in ids] == ["a", "", "", "", "🎉"]


def test_byte_fallback_tokenizer_streams_split_characters(make_detok, byte_fallback):
    text = "the é漢🎉 fox"  # '🎉' is not in the vocab: four <0xNN> tokens
    ids = byte_fallback.encode(text, add_special_tokens=False)
    assert "<0xF0>" in byte_fallback.convert_ids_to_tokens(ids)
    detok = make_detok(byte_fallback.encode("the", add_special_tokens=False), tokenizer=byte_fallback)
    pieces = [detok.append(t) for t in ids]
    assert all(FFFD not in p for p in pieces)
    # The prompt gives the first output token its context: its leading space is kept (decoding the output
    # alone would strip it, as SentencePiece decoders strip the first token's space).
    assert detok.text == " " + text


def test_inconsistent_decoder_prefix_keeps_streaming(byte_fallback):
    # ByteFallback decodes a byte run that turns invalid later as all U+FFFD, so the text of an earlier
    # window is no longer a prefix (DecodeStream raises "Invalid prefix"); streaming must go on.
    tokens = ["<0xC3>", "<0xBC>", "<0xE6>", "a", "▁end"]
    detok = IncrementalDetokenizer(byte_fallback, byte_fallback.encode("the", add_special_tokens=False))
    for token in tokens:
        detok.append(byte_fallback.convert_tokens_to_ids(token))
    assert detok.text.startswith("ü")  # emitted when it was valid
    assert detok.text.endswith("a end")


def test_special_tokens_follow_skip_special_tokens(make_detok, byte_level):
    ids = byte_level.encode("fox") + [byte_level.eos_token_id]
    for skip, expected in [(True, "fox"), (False, "fox<|eos|>")]:
        detok = make_detok(byte_level.encode("The"), skip_special_tokens=skip)
        for t in ids:
            detok.append(t)
        assert detok.text == expected


def test_empty_prompt(make_detok, byte_level):
    detok = make_detok([])
    assert detok.append(byte_level.encode("fox")[0]) == byte_level.decode(byte_level.encode("fox")[:1])


def test_offsets_path_decodes_short_windows(byte_level):
    # Cost per token must not grow with the output: every decoded window stays a few tokens long.
    slow = PythonOnlyTokenizer(byte_level)
    detok = IncrementalDetokenizer(slow, byte_level.encode("The"))
    ids = byte_level.encode(" ".join(CORPUS) * 20)
    slow.window_lengths.clear()
    for t in ids:
        detok.append(t)
    assert detok.text == byte_level.decode(ids)
    assert len(ids) > 500 and max(slow.window_lengths) <= 12


# ---- stop strings -------------------------------------------------------------------------------------


def stream_until_stop(pieces, stop, include):
    text = ""
    for piece in pieces:
        text += piece
        match = find_stop_string(text, len(piece), stop, include)
        if match is not None:
            return text[: match.keep_chars], match
    return text, None


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_pieces(include):
    text, match = stream_until_stop(["Hel", "lo ST", "OP now", " more"], ("STOP",), include)
    assert match == StopMatch("STOP", 10 if include else 6)
    assert text == ("Hello STOP" if include else "Hello ")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_with_real_tokens(make_detok, byte_level, include):
    ids = byte_level.encode("The answer is 42.\n\nUser: thanks")
    detok = make_detok(byte_level.encode("Q"))
    for t in ids:
        new = detok.append(t)
        match = find_stop_string(detok.text, len(new), ["\n\nUser:"], include)
        if match:
            break
    assert match is not None
    assert detok.text[: match.keep_chars] == ("The answer is 42.\n\nUser:" if include else "The answer is 42.")


def test_first_completed_stop_string_wins():
    # Both complete in the same piece; "bc" completes before "abcd" and before "cde".
    assert find_stop_string("xxabcde", 5, ["cde", "abcd", "bc"], False) == StopMatch("bc", 3)
    # Same end: the longer string (starting earlier) is cut.
    assert find_stop_string("xxabc", 3, ["bc", "abc"], False) == StopMatch("abc", 2)


def test_stop_search_only_where_a_new_match_can_end():
    assert find_stop_string("STOP and more", 4, ["STOP"], False) is None  # found by an earlier call
    assert find_stop_string("abcSTOP", 1, ["STOP"], True) == StopMatch("STOP", 7)
    assert find_stop_string("abc", 0, ["abc"], False) is None
    assert find_stop_string("abc", 3, [], False) is None


def test_releasable_text_holds_back_stop_prefixes():
    assert releasable_text("Hello wor", ["world!"], finished=False) == "Hello "
    assert releasable_text("Hello worm", ["world!"], finished=False) == "Hello worm"
    assert releasable_text("Hello wor", ["world!"], finished=True) == "Hello wor"
    assert releasable_text("ab", ["b?", "abc"], finished=False) == ""  # the longest held suffix wins
    assert releasable_text("xa", ["aaa"], finished=False) == "x"
    assert releasable_text("text", [], finished=False) == "text"


@pytest.mark.parametrize("include", [False, True])
def test_streaming_client_never_sees_part_of_a_stop_string(include):
    stop = ("</answer>",)
    checker = StopChecker(stop, include)
    pieces = ["The ", "value <", "/ans", "wer is < 3 <", "/an", "swer> trailing"]
    text, sent = "", ""
    for piece in pieces:
        text, finished = checker.check(text + piece, len(piece))
        visible = checker.releasable(text, finished)
        assert visible.startswith(sent)  # released text is never taken back
        sent = visible
        if finished:
            break
        assert not any(sent.endswith(stop[0][:n]) for n in range(1, len(stop[0])))
    assert sent == "The value </answer is < 3 " + ("</answer>" if include else "")


# ---- stop strings against brute-force references, over random texts on a tiny alphabet (where matches,
# overlaps and partial matches are frequent) ---------------------------------------------------------------
ALPHABET = "ab"
texts = st.text(ALPHABET, max_size=12)
stops = st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3)


def reference_find(text, num_new, stop, include):
    """Every occurrence of every stop string that ends in the last num_new characters; the earliest end wins,
    then the earliest start (the longer string)."""
    if num_new <= 0:
        return None
    found = [(i + len(s), i, s) for s in stop for i in range(len(text) - len(s) + 1)
             if text.startswith(s, i) and i + len(s) > len(text) - num_new]
    if not found:
        return None
    end, start, s = min(found, key=lambda f: f[:2])
    return StopMatch(s, end if include else start)


def reference_releasable(text, stop, finished):
    """Hold back the longest suffix of text that is a proper prefix of a stop string."""
    if finished:
        return text
    held = max((n for s in stop for n in range(1, len(s)) if len(text) >= n and text.endswith(s[:n])), default=0)
    return text[: len(text) - held]


@settings(max_examples=400, deadline=None)
@given(texts, st.integers(-1, 14), stops, st.booleans())
def test_find_stop_string_equals_brute_force(text, num_new, stop, include):
    got = find_stop_string(text, num_new, stop, include)
    want = reference_find(text, min(num_new, len(text)), stop, include)
    # Several stop strings may be equal: only the cut and the matched text matter.
    assert (got is None) == (want is None)
    if got is not None:
        assert (got.keep_chars, got.stop_str) == (want.keep_chars, want.stop_str)


@settings(max_examples=400, deadline=None)
@given(texts, stops, st.booleans())
def test_releasable_text_equals_brute_force(text, stop, finished):
    assert releasable_text(text, stop, finished) == reference_releasable(text, stop, finished)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(ALPHABET, min_size=1, max_size=3), max_size=8), stops, st.booleans())
def test_stop_checker_streams_like_one_search_over_the_whole_text(pieces, stop, include):
    checker = StopChecker(stop, include)
    assert checker.stop == tuple(stop) and checker.include_stop_str_in_output == include
    text, sent, finished = "", "", False
    for piece in pieces:
        text, finished = checker.check(text + piece, len(piece))
        visible = checker.releasable(text, finished)
        assert visible.startswith(sent) and visible == reference_releasable(text, stop, finished)
        sent = visible
        if finished:
            break
    whole = "".join(pieces)
    # Where the earliest-ending match over the whole text cuts it, streaming cut it too.
    first = reference_find(whole, len(whole), stop, include)
    assert finished == (first is not None)
    assert text == (whole if first is None else whole[: first.keep_chars])


def test_defaults_cut_before_the_stop_string_and_hold_back_prefixes():
    checker = StopChecker(["b"])
    assert checker.check("aab", 1) == ("aa", True)
    assert checker.check("aaa", 1) == ("aaa", False)
    assert find_stop_string("aab", 1, ["b"]) == StopMatch("b", 2)  # include_stop_str_in_output defaults off
    assert StopChecker(["ab"]).releasable("xa") == "x"  # unfinished unless told otherwise
