"""Streamed text from the per-token table (engine/token_texts.py): the same text as the incremental detokenizer,
whether a sequence stays on the table or leaves it for the bytes of a split character and comes back."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models

from ostinato import RequestOutputKind, SamplingParams
from ostinato.engine import detokenizer as detok_mod
from ostinato.engine.outputs import merge_deltas
from ostinato.engine.token_texts import token_texts
from support.tiny_llm import tiny_llm

FFFD = "\ufffd"


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory, "token-texts-ckpt", seed=5, num_kv_blocks=256, max_model_len=128, max_num_seqs=16)


def test_the_table_holds_each_tokens_own_text_or_none_for_part_of_a_character(llm):
    tok = llm.engine.tokenizer
    for skip in (True, False):
        table = token_texts(tok, skip)
        ids = range(len(tok) + 3)
        texts = [table[i] for i in ids]  # filled as met
        assert len(table) == len(ids) and texts[-3:] == [None] * 3  # past the vocabulary: the detokenizer's
        alone = [tok.backend_tokenizer.decode([i], skip_special_tokens=skip) for i in range(len(tok))]
        assert texts[:len(tok)] == [None if FFFD in t else t for t in alone]
        assert 0 < texts.count(None) - 3 < len(tok) // 2  # the tiny BPE's lone high bytes
    assert token_texts(tok, True)[tok.eos_token_id] == ""  # a skipped special token adds no text
    assert token_texts(tok, False)[tok.eos_token_id] == tok.eos_token


def test_a_decoder_that_is_not_byte_level_gets_no_table():
    vocab = {"<unk>": 0, "▁a": 1, "b": 2}
    sentencepiece = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    sentencepiece.decoder = decoders.Metaspace()
    assert token_texts(sentencepiece, True) is None


def test_delta_and_final_only_runs_of_the_same_requests_give_the_same_texts(llm, monkeypatch):
    """Sampled at temperature 1 from random weights, the outputs are full of lone bytes that split characters,
    so sequences leave the table and come back; streamed or decoded once at the end, the texts agree, and
    they are what the incremental detokenizer alone gives."""
    appended, made = [], []
    real_append, real_init = detok_mod.IncrementalDetokenizer.append, detok_mod.IncrementalDetokenizer.__init__
    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "append",
                        lambda self, t: appended.append(t) or real_append(self, t))
    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "__init__",
                        lambda self, *a, **k: made.append(1) or real_init(self, *a, **k))
    prompts = [[(7 * i + j) % 400 + 4 for j in range(5 + i % 7)] for i in range(16)]
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    final = llm.generate(prompts, params)
    made.clear(), appended.clear()
    engine = llm.engine
    stream = SamplingParams(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"d{i}", prompt, stream)
    deltas: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out)
    streamed = [merge_deltas(deltas[f"d{i}"]).outputs[0] for i in range(len(prompts))]
    assert [(c.token_ids, c.text) for c in streamed] == [(o.outputs[0].token_ids, o.outputs[0].text) for o in final]
    num_tokens = sum(len(c.token_ids) for c in streamed)
    # Both paths ran: most tokens came from the table, and sequences left it (a detokenizer made mid-stream).
    assert len(appended) < num_tokens // 2 and len(made) > len(prompts)
    # And the text is the incremental detokenizer's, token by token, all the way.
    for prompt, c in zip(prompts, streamed):
        detok = detok_mod.IncrementalDetokenizer(engine.tokenizer, prompt)
        assert "".join(map(detok.append, c.token_ids)) == c.text
    assert any(FFFD in c.text for c in streamed)  # invalid byte runs were streamed too
