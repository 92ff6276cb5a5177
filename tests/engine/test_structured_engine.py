"""The engine's grammar path on a tiny random checkpoint (fast; the real-model tests are in
tests/e2e/test_structured_outputs.py): random weights never follow a format on their own, so every constrained
output that holds is the mask's doing. Sampled rows, prefill and decode draws, a mixed step, overlap on and off."""

import re

import pytest

pytest.importorskip("xgrammar")

from ostinato.config import EngineArgs  # noqa: E402
from ostinato.engine.llm import LLM  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402
from ostinato.structured_outputs import StructuredOutputs  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

PATTERN = "[0-9]{2}-[a-z]{3}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("structured-tiny")
    make_checkpoint(path, shape="tiny", family="qwen3", seed=2)
    return path


def _llm(ckpt, **kw):
    args = dict(model=str(ckpt), device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=128, max_num_seqs=8)
    return LLM.from_engine_args(EngineArgs(**{**args, **kw}))


@pytest.fixture(scope="module")
def llm(ckpt):
    return _llm(ckpt)


def _constrained(n: int) -> list[SamplingParams]:
    regex = StructuredOutputs(regex=PATTERN)
    choice = StructuredOutputs(choice=("alpha", "beta gamma"))
    return [SamplingParams(temperature=1.0, seed=s, max_tokens=20, structured_outputs=regex if s % 2 else choice)
            for s in range(n)]


def _check(outs, params):
    for out, p in zip(outs, params):
        text = out.outputs[0].text
        if p.structured_outputs.kind == "regex":
            assert re.fullmatch(PATTERN, text), text
        else:
            assert text in ("alpha", "beta gamma"), text
        assert out.outputs[0].finish_reason == "stop"


def test_sampled_rows_follow_their_grammar(llm):
    params = _constrained(6)
    _check(llm.generate(["hello world"] * 6, params), params)


def test_plain_rows_keep_their_tokens_beside_constrained_ones(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(["one two", "three"], plain)]
    params = _constrained(4)
    outs = llm.generate(["one two", "x", "three", "y", "z", "w"], [plain[0], params[0], plain[1], *params[1:]])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    _check([outs[1], *outs[3:]], params)


def test_overlap_on_and_off_and_mixed_steps_agree(ckpt, llm):
    params = _constrained(6)
    prompts = ["a b c " * k for k in range(1, 7)]  # staggered prompt lengths: rows join while others decode
    overlapped = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    serial = _llm(ckpt, async_scheduling=False, max_num_batched_tokens=16)  # small budget: mixed steps
    assert [o.outputs[0].token_ids for o in serial.generate(prompts, params)] == overlapped


def test_a_complete_grammar_ends_its_sequence_even_when_eos_is_ignored(llm):
    # ignore_eos takes the stop token out of the request's own stop ids: only the grammar's end stops the row
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=20, ignore_eos=True,
                             structured_outputs=StructuredOutputs(choice=("alpha", "beta gamma"))) for s in range(3)]
    outs = llm.generate(["hello"] * 3, params)
    assert all(o.outputs[0].finish_reason == "stop" and o.outputs[0].text in ("alpha", "beta gamma") for o in outs)
