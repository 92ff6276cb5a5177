"""The no-op forward (tools/bench/noop_forward.py) with grammar-constrained rows, as bench_structured's CPU mode runs
it: the masking edits each step's fresh logits, never the no-op's own, and a re-draw never leaks into the next
request's 'sampled' tokens."""

import re

import pytest

pytest.importorskip("xgrammar")

from ostinato.config import EngineArgs  # noqa: E402
from ostinato.engine.engine import LLMEngine  # noqa: E402
from ostinato.sampling_params import SamplingParams  # noqa: E402
from ostinato.structured_outputs import StructuredOutputs  # noqa: E402
from ostinato.tools.bench import noop_forward  # noqa: E402
from ostinato.tools.checkpoint import make_checkpoint  # noqa: E402

PATTERN = "[0-9]{2}-[a-z]{3}"


def _run(engine, params: list[SamplingParams]) -> list:
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [5, 6, 7 + i], p)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    return [outs[f"r{i}"] for i in range(len(params))]


def test_constrained_rows_follow_their_grammar_and_plain_rows_keep_the_no_op_token(tmp_path):
    make_checkpoint(tmp_path, shape="tiny")
    engine = LLMEngine(EngineArgs(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=64,
                                  num_kv_blocks=64, max_num_seqs=4))
    token = noop_forward.install(engine, step_ms=0.2, logits_columns=300)  # delayed steps: masks through launch
    constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(regex=PATTERN))
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for _ in range(2):  # a second round: the first one's masking left the no-op's logits as they were
        # the constrained rows end first: the plain rows after them move into their rows
        outs = _run(engine, [constrained, constrained, plain, plain])
        assert all(re.fullmatch(PATTERN, o.text) for o in outs[:2])
        assert all(o.token_ids == [token] * 16 for o in outs[2:])
