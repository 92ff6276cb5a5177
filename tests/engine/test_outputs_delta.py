"""Outputs as deltas: DELTA outputs join into exactly what LLM.generate returns (greedy, n > 1,
stop strings, logprobs); a stream never shows part of a stop string; and what the engine builds per step does
not grow with the length of the output."""

import json
from dataclasses import replace

import pytest

from ostinato import RequestOutputKind, SamplingParams
from ostinato.engine import detokenizer as detok_mod
from ostinato.engine import step_outputs as step_outputs_mod
from ostinato.engine.detokenizer import OutputText
from ostinato.engine.outputs import merge_deltas
from ostinato.tools.checkpoint import make_checkpoint
from support.tiny_llm import tiny_llm

DELTA, FINAL, CUMULATIVE = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory, "delta-ckpt", seed=3, num_kv_blocks=128, max_model_len=512)


def _run(engine, request_id, prompt, params):
    """Every output the engine gives one request, step by step, until it finishes."""
    engine.add_request(request_id, prompt, params)
    outs = []
    while True:
        step = [o for o in engine.step() if o.request_id == request_id]
        outs += step
        if step and step[-1].finished:
            return outs


def _free_text(llm, prompt):
    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))[0].outputs[0].text


def _cases(llm):
    text = _free_text(llm, [5, 6, 7])
    stop = text[len(text) // 2: len(text) // 2 + 3]  # a piece the model is known to write, mid-output
    assert stop.strip(), text
    return {
        "greedy": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)),
        "n3-seeded": ([3, 4], SamplingParams(temperature=1.0, n=3, seed=7, max_tokens=20, ignore_eos=True)),
        "stop-string": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])),
        "stop-included": ([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True)),
        "logprobs-n2": ([8, 9], SamplingParams(temperature=0.8, n=2, seed=1, max_tokens=12, logprobs=3,
                                               ignore_eos=True)),
    }


@pytest.mark.parametrize("case", ["greedy", "n3-seeded", "stop-string", "stop-included", "logprobs-n2"])
def test_deltas_join_into_the_offline_output(llm, case):
    from dataclasses import replace

    prompt, params = _cases(llm)[case]
    offline = llm.generate([prompt], params)[0]
    assert offline.finished and len(offline.outputs) == params.n
    deltas = _run(llm.engine, f"delta-{case}", prompt, replace(params, output_kind=DELTA))
    assert all(not d.finished for d in deltas[:-1]) and deltas[-1].finished
    joined = merge_deltas(deltas)
    cumulative = _run(llm.engine, f"cumul-{case}", prompt, replace(params, output_kind=CUMULATIVE))[-1]
    for whole in (joined, cumulative):
        assert [c.index for c in whole.outputs] == [c.index for c in offline.outputs]
        for got, want in zip(whole.outputs, offline.outputs):
            assert got.text == want.text and got.token_ids == want.token_ids
            assert got.finish_reason == want.finish_reason
            assert got.logprobs == want.logprobs
    if case.startswith("stop"):
        assert offline.outputs[0].finish_reason == "stop"
    # Every completion reports its finish reason exactly once, in its last delta.
    for index in range(params.n):
        reasons = [c.finish_reason for d in deltas for c in d.outputs if c.index == index]
        assert reasons[-1] is not None and all(r is None for r in reasons[:-1])


def test_a_stream_never_shows_part_of_a_stop_string(llm):
    text = _free_text(llm, [5, 6, 7])
    # A stop string whose first characters appear in the output before the place where it matches: those
    # characters must be held back, then released once the next token shows they are not the stop string.
    stop = text[len(text) // 2: len(text) // 2 + 4]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop], output_kind=DELTA)
    deltas = _run(llm.engine, "no-leak", [5, 6, 7], params)
    final = "".join(c.text for d in deltas for c in d.outputs)
    assert final == text[: text.index(stop)]
    shown = ""
    for d in deltas:
        shown += "".join(c.text for c in d.outputs)
        assert final.startswith(shown)  # nothing shown was ever taken back


def test_output_text_holds_back_a_possible_stop_string_and_cuts_at_one():
    out = OutputText(["STOP"])
    assert not out.append("abc ST")
    assert out.text == "abc "  # "ST" could be the start of "STOP"
    assert not out.append("x")
    assert out.text == "abc STx"  # it was not
    assert out.append("yS") is False and out.text == "abc STxy"
    assert out.append("TOP and more")
    assert out.text == "abc STxy"  # cut before the stop string
    kept = OutputText(["STOP"], include_stop_str_in_output=True)
    assert kept.append("a STOP b") and kept.text == "a STOP"
    tail = OutputText(["END"])
    tail.append("fine E")
    tail.finish()  # EOS: the held "E" can no longer become "END"
    assert tail.text == "fine E"


def test_llm_generate_still_returns_whole_outputs_whatever_the_output_kind(llm):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    base = llm.generate([[1, 2, 3], [4, 5]], params)
    for kind in (DELTA, CUMULATIVE):
        from dataclasses import replace

        again = llm.generate([[1, 2, 3], [4, 5]], replace(params, output_kind=kind))
        assert [(o.request_id != b.request_id, o.outputs[0].token_ids, o.outputs[0].text, o.finished)
                for o, b in zip(again, base)] == [(True, b.outputs[0].token_ids, b.outputs[0].text, True)
                                                  for b in base]
        assert all(len(o.outputs[0].token_ids) == 10 for o in again)


def test_what_a_step_builds_does_not_grow_with_the_output(llm, monkeypatch):
    """Counts the work, not the time: per step, a DELTA request gets one token, its text and logprob; no
    whole-output text is joined and no whole completion built until the request finishes."""
    joins, wholes = [], []
    real_text, real_whole = OutputText.text, step_outputs_mod.whole_completion
    monkeypatch.setattr(OutputText, "text", property(lambda self: joins.append(1) or real_text.fget(self)))
    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "text",
                        property(lambda self: joins.append(1) or "".join(self._pieces)))
    monkeypatch.setattr(step_outputs_mod, "whole_completion", lambda st: wholes.append(1) or real_whole(st))
    n_tokens = 300
    params = SamplingParams(temperature=0.0, max_tokens=n_tokens, ignore_eos=True, logprobs=2, stop=["zzzz"],
                            output_kind=DELTA)
    deltas = _run(llm.engine, "per-step", [7, 8, 9], params)
    assert len(deltas) == n_tokens  # one output per step, each with one new token
    for d in deltas:
        (c,) = d.outputs
        assert len(c.token_ids) == 1 and len(c.logprobs) == 1 and len(c.text) <= 64
    assert not joins and not wholes
    final = _run(llm.engine, "final-only", [7, 8, 9], SamplingParams(
        temperature=0.0, max_tokens=n_tokens, ignore_eos=True, output_kind=FINAL))
    assert len(final) == 1 and len(final[0].outputs[0].token_ids) == n_tokens
    assert len(wholes) == 1 and len(joins) == 1  # built once, when the request finished


def test_stream_chunks_written_directly_equal_the_pydantic_models():
    """The server writes stream chunks as JSON itself (per-token pydantic models cost too much); each chunk must
    be exactly what the response models would have written."""
    import asyncio

    pytest.importorskip("fastapi")
    from ostinato.engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
    from ostinato.server.streaming import Formatter, chat_events, completion_events
    from ostinato.server.protocol import (ChatChunkChoice, ChatCompletionChunk, CompletionChoice,
                                          CompletionResponse, DeltaMessage)

    class Tokenizer:
        def decode(self, ids):
            return {5: "é", 6: " \"q\"\n", 7: "x"}[ids[0]]

    fmt = Formatter(Tokenizer())
    logprobs = [TokenLogprob(5, -0.5, [(5, -0.5), (7, -1.0)]), TokenLogprob(7, -2.0, [(7, -2.0)]),
                TokenLogprob(6, -0.25, [(6, -0.25)])]
    steps = [RequestOutput("r", None, [1, 2], [CompletionOutput(0, "é", [5], None, [logprobs[0]])], False, 0.0),
             # no text yet (a special token, or part of a character): content null
             RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [7], None, [logprobs[1]])], False, 0.0),
             RequestOutput("r", None, [1, 2], [CompletionOutput(0, ' "q"\n', [6], "stop", [logprobs[2]])], True, 0.0)]

    async def stream():
        for out in steps:
            yield out

    async def lines(events):
        return [e async for e in events]

    for want_lp in (False, True):
        got = asyncio.run(lines(completion_events(stream(), "cmpl-1", "m", fmt, want_lp, False)))
        offset = _ChoiceCursorLike()
        for event, out in zip(got, steps):
            (c,) = out.outputs
            lp = fmt.completion_logprobs(c, offset) if want_lp else None
            model = CompletionResponse(id="cmpl-1", model="m", choices=[
                CompletionChoice(index=0, text=c.text, logprobs=lp, finish_reason=c.finish_reason)])
            created = json.loads(event[len("data: "):])["created"]
            assert event == f"data: {model.model_copy(update={'created': created}).model_dump_json()}\n\n"
        assert got[-1] == "data: [DONE]\n\n"
        got = asyncio.run(lines(chat_events(stream(), "chat-1", "m", fmt, want_lp, 1, False)))[1:]  # after the role
        for event, out in zip(got, steps):
            (c,) = out.outputs
            model = ChatCompletionChunk(id="chat-1", model="m", choices=[
                ChatChunkChoice(index=0, delta=DeltaMessage(content=c.text or None), finish_reason=c.finish_reason,
                                logprobs=fmt.chat_logprobs(c) if want_lp else None)])
            created = json.loads(event[len("data: "):])["created"]
            assert event == f"data: {model.model_copy(update={'created': created}).model_dump_json()}\n\n"


class _ChoiceCursorLike:
    """A fresh text-offset counter, as the server's cursor keeps one per completion."""

    num_tokens = 0
    text_offset = 0


def test_final_only_decodes_text_once_unless_stop_strings_need_it(llm, monkeypatch):
    """Counts calls, not time: a FINAL_ONLY request (LLM.generate's) without stop strings is never detokenized
    per step, only once when it finishes (with logprobs too, and for each of n completions); with stop strings
    every token is, since any token may complete one. Either way the text is what DELTA streams."""
    appends, wholes = [], []
    real_append, real_all = detok_mod.IncrementalDetokenizer.append, detok_mod.IncrementalDetokenizer.decode_all
    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "append",
                        lambda self, t: appends.append(t) or real_append(self, t))
    monkeypatch.setattr(detok_mod.IncrementalDetokenizer, "decode_all",
                        lambda self, ids: wholes.append(len(ids)) or real_all(self, ids))
    params = SamplingParams(temperature=0.7, seed=5, n=2, max_tokens=25, ignore_eos=True, logprobs=1)
    engine = llm.engine
    engine.add_request("final-no-stop", [4, 5, 6], replace(params, output_kind=FINAL))
    steps, final = 0, []
    while not final:
        final = engine.step()
        steps += 1
        assert final or not appends  # no text while it runs
    assert steps >= 25 and wholes == [25, 25]  # then each completion's text, once
    (final,) = final
    appends.clear()
    deltas = _run(engine, "delta-same", [4, 5, 6], replace(params, output_kind=DELTA))
    assert len(appends) == 50  # a stream needs each token's text
    assert [c.text for c in merge_deltas(deltas).outputs] == [c.text for c in final.outputs]
    appends.clear()
    wholes.clear()
    stop = final.outputs[0].text[-3:]
    (stopped,) = _run(engine, "final-stop", [4, 5, 6], replace(params, output_kind=FINAL, stop=[stop]))
    assert not wholes and len(appends) == sum(len(c.token_ids) for c in stopped.outputs)  # text every token


def _scripted_engine(path):
    """A tiny engine whose no-op forward 'samples' a scripted token sequence (tools/bench/noop_forward.py): the text
    is then known, multi-byte characters split across tokens included."""
    from ostinato.config import EngineArgs
    from ostinato.engine.engine import LLMEngine
    from ostinato.tools.bench import noop_forward

    engine = LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", num_kv_blocks=64,
                                  max_model_len=256, max_num_seqs=4))
    noop_forward.install(engine)
    runner = engine.runner

    def play(token_ids):
        tokens = iter(token_ids[1:])
        runner.model._logits.zero_()
        runner.model._logits[:, token_ids[0]] = 1.0  # the prefill's token
        logits = runner.model._logits

        def step(**inputs):
            runner.decode_step.sampled.fill_(next(tokens, token_ids[-1]))
            return logits[: next(iter(inputs.values())).shape[0]]

        runner.graphs.fn = step

    return engine, play


def test_deltas_join_into_the_final_text_with_split_characters_and_a_stop_string(tmp_path):
    """One token per byte of a text full of multi-byte characters: DELTA pieces never hold half a character or
    part of the stop string, join into exactly the final text, and the final text of a FINAL_ONLY request (one
    decode at the end, or token by token with stop strings) is the same."""
    from tokenizers import pre_tokenizers

    make_checkpoint(tmp_path, shape="tiny", family="llama", seed=3)
    engine, play = _scripted_engine(tmp_path)
    text = "café 漢字 🎉 naïve 🚀 fin"
    [(mapped, _)] = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    ids = [engine.tokenizer.convert_tokens_to_ids(c) for c in mapped]
    assert len(ids) == len(text.encode()) and engine.tokenizer.unk_token_id not in ids
    for stop, want in (((), text), (("🚀",), text[: text.index("🚀")]),
                       (("ve 🚀",), text[: text.index("ve 🚀")])):
        texts = {}
        for kind in (DELTA, FINAL):
            play(ids)
            params = SamplingParams(temperature=0.0, max_tokens=len(ids), ignore_eos=True, stop=list(stop),
                                    output_kind=kind)
            outs = _run(engine, f"{kind.value}-{len(stop)}-{want[-2:]}", [5, 6, 7], params)
            if kind is DELTA:
                pieces = [c.text for o in outs for c in o.outputs]
                assert len(pieces) > 3 and all("\ufffd" not in p for p in pieces)
                shown = ""
                for piece in pieces:
                    shown += piece
                    assert want.startswith(shown)  # nothing shown is taken back, no stop string leaks
            texts[kind] = merge_deltas(outs).outputs[0].text
        assert texts[DELTA] == texts[FINAL] == want, (stop, texts)
