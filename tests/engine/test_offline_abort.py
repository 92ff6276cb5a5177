"""An LLM.generate or LLM.chat stopped midway, by an error inside a step or by Ctrl-C, aborts its whole batch:
the engine holds no request and no KV block afterwards, and the next call gives what a fresh engine gives."""

import pytest

from ostinato import SamplingParams
from ostinato.engine import detokenizer
from support.tiny_llm import tiny_llm

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory, "abort-ckpt", num_kv_blocks=64, max_model_len=64, max_num_seqs=2)


@pytest.fixture(scope="module")
def reference(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


class InterruptedRunner:
    """The engine's runner, except that its launch number `at` raises `error` (as Ctrl-C would mid-batch)."""

    def __init__(self, runner, at: int, error: BaseException):
        self._runner, self._at, self._error, self.launches = runner, at, error, 0

    def launch(self, out):
        self.launches += 1
        if self.launches == self._at:
            raise self._error
        return self._runner.launch(out)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def assert_clean(llm):
    st = llm.engine.stats()
    assert not llm.engine.has_unfinished()
    assert st.num_running == st.num_waiting == 0
    assert st.kv_blocks_free == st.kv_blocks_total


@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("a step failed")],
                         ids=["ctrl-c", "runtime-error"])
def test_an_interrupted_generate_leaves_the_engine_clean(llm, reference, monkeypatch, error):
    runner = InterruptedRunner(llm.engine.runner, at=4, error=error)
    monkeypatch.setattr(llm.engine, "runner", runner)
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, GREEDY)
    assert runner.launches == 4  # it stopped inside the batch: some requests ran, some waited
    assert_clean(llm)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
    assert_clean(llm)


def test_an_error_while_detokenizing_aborts_the_batch(llm, reference, monkeypatch):
    def fail(self, token_ids):
        raise KeyboardInterrupt

    monkeypatch.setattr(detokenizer.IncrementalDetokenizer, "decode_all", fail)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    assert_clean(llm)
    monkeypatch.undo()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_an_interrupted_chat_leaves_the_engine_clean(llm, monkeypatch):
    chat = [{"role": "user", "content": "hello"}]
    want = llm.chat([chat, chat], GREEDY)
    monkeypatch.setattr(llm.engine, "runner", InterruptedRunner(llm.engine.runner, at=2, error=KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        llm.chat([chat, chat], GREEDY)
    assert_clean(llm)
    monkeypatch.undo()
    got = llm.chat([chat, chat], GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_stream_gives_generate_s_output_in_deltas_and_a_stream_left_early_aborts(llm, reference):
    from ostinato.engine.outputs import merge_deltas

    deltas = list(llm.stream(PROMPTS[0], GREEDY))
    assert len(deltas) > 1 and deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert merge_deltas(deltas).outputs[0].token_ids == reference[0]
    assert_clean(llm)
    stream = llm.stream(PROMPTS[1], GREEDY)
    next(stream)
    assert llm.engine.has_unfinished()
    stream.close()  # what a `break` out of the loop (or Ctrl-C inside it) does to the generator
    assert_clean(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference
