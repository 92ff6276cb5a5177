"""Structured outputs on the real SmolLM2 model (CPU, fp32), offline: 50 generated JSON schemas (greedy and
sampled) validate with `jsonschema`; regex and choice constraints hold; constrained rows leave the unconstrained
rows of their batch unchanged; overlapped scheduling on and off give the same constrained tokens; a compile never
blocks the engine, and one that is too slow is refused."""

from __future__ import annotations

import json
import re
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("xgrammar")
import jsonschema  # noqa: E402

from ostinato import LLM, SamplingParams  # noqa: E402
from ostinato.engine import grammar  # noqa: E402
from ostinato.errors import InvalidRequestError  # noqa: E402
from ostinato.structured_outputs import StructuredOutputs  # noqa: E402
from test_smollm2 import MODEL, cache_env, report  # noqa: E402,F401  (module fixtures: the converted model)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.schemas import generated_schemas  # noqa: E402

SCHEMA_TOKENS = 96  # the nested schemas need up to ~60 tokens; the limit only bounds a runaway


def _llm(**kw):
    args = dict(dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=1024, max_num_seqs=128)
    return LLM(MODEL, **{**args, **kw})


@pytest.fixture(scope="module")
def llm(report):  # noqa: F811
    return _llm()


def _ask(fields) -> list[dict]:
    return [{"role": "user", "content": "Reply with a JSON object with the fields " + ", ".join(fields)}]


def test_50_generated_schemas_validate_greedy_and_sampled(llm):
    schemas = generated_schemas(50)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=SCHEMA_TOKENS,
                             structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(schemas) for t in (0.0, 0.8)]
    outs = llm.chat([_ask(s["properties"]) for s in schemas for _ in range(2)], params)  # one batch of 100
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, p.structured_outputs.json)  # complete, not cut by max_tokens
        jsonschema.validate(json.loads(c.text), p.structured_outputs.schema)


def test_regex_and_choice_hold(llm):
    pattern = r"[A-Z][a-z]{2,5} [0-9]{2}"
    params = [SamplingParams(temperature=t, seed=s, max_tokens=16, structured_outputs=StructuredOutputs(regex=pattern))
              for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    params += [SamplingParams(temperature=1.0, seed=s, max_tokens=8,
                              structured_outputs=StructuredOutputs(choice=("yes", "no", "maybe"))) for s in range(3)]
    outs = llm.generate(["The name and number are"] * 6, params)
    for out in outs[:3]:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    for out in outs[3:]:
        assert out.outputs[0].text in ("yes", "no", "maybe")


def test_unconstrained_rows_unchanged_beside_constrained_ones(llm):
    plain = [SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(temperature=1.0, seed=7, max_tokens=12)]
    prompts = ["The capital of France is", "Once upon a time"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    constrained = [SamplingParams(temperature=0.0, max_tokens=12,
                                  structured_outputs=StructuredOutputs(json_object=True)),
                   SamplingParams(temperature=1.0, seed=3, max_tokens=12,
                                  structured_outputs=StructuredOutputs(regex="[0-9]+"))]
    mixed = llm.generate(["Data:", prompts[0], "Count:", prompts[1]],
                         [constrained[0], plain[0], constrained[1], plain[1]])
    assert [mixed[1].outputs[0].token_ids, mixed[3].outputs[0].token_ids] == alone
    assert re.fullmatch("[0-9]+", mixed[2].outputs[0].text)


def test_overlap_on_and_off_give_the_same_constrained_tokens(llm, report):  # noqa: F811
    schemas = generated_schemas(6, seed=1)
    params = [SamplingParams(temperature=t, seed=i, max_tokens=SCHEMA_TOKENS,
                             structured_outputs=StructuredOutputs(json=s))
              for i, s in enumerate(schemas) for t in (0.0, 1.0)]
    prompts = [_ask(s["properties"]) for s in schemas for _ in range(2)]
    overlapped = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    serial = _llm(async_scheduling=False, max_num_seqs=16, num_kv_blocks=256)
    assert [o.outputs[0].token_ids for o in serial.chat(prompts, params)] == overlapped


def test_a_compiling_grammar_holds_its_request_not_the_engine(llm, monkeypatch):
    release = threading.Event()
    compile_once = grammar.GrammarCompiler._run

    def slow(self, spec):
        release.wait(60)
        return compile_once(self, spec)

    monkeypatch.setattr(grammar.GrammarCompiler, "_run", slow)
    engine = llm.engine
    spec = StructuredOutputs(regex="(held|late)")  # a key no other test compiled
    engine.add_request("held", "Say:", SamplingParams(temperature=0.0, max_tokens=4, structured_outputs=spec))
    engine.add_request("free", "Hello", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    done = {}
    for _ in range(50):
        done.update({o.request_id: o for o in engine.step() if o.finished})
        if "free" in done:
            break
    assert "free" in done and "held" not in done  # the plain request ran while the grammar compiled
    release.set()
    while "held" not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["held"].outputs[0].text in ("held", "late")


def test_a_slow_compile_is_refused_naming_the_field(llm, monkeypatch):
    release = threading.Event()
    def never(self, spec):
        release.wait(30)
        raise RuntimeError("released")  # a failed compile is not cached: nothing of this test stays behind

    monkeypatch.setattr(grammar.GrammarCompiler, "_run", never)
    spec = StructuredOutputs(regex="(never|ready)")
    try:
        with pytest.raises(InvalidRequestError, match="did not compile within") as e:
            llm.engine.constrained.check(spec, 0.2)
        assert e.value.param == "structured_outputs.regex"
    finally:
        release.set()


def test_bad_regex_raises_before_anything_is_queued(llm):
    with pytest.raises(InvalidRequestError, match="does not compile") as e:
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2),
                                  SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(regex="(a"))])
    assert e.value.param == "structured_outputs.regex"
    assert not llm.engine.has_unfinished()
