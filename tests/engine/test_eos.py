"""A sequence ends on its EOS token unless ignore_eos: checked on a checkpoint whose EOS is a token the model
is known to produce mid-output (taken from a greedy run with ignore_eos on the unchanged checkpoint).

The EOS id is declared in generation_config.json, the way real checkpoints (e.g. Llama 3's list of EOS ids)
declare it."""

import json
import shutil

import pytest

from ostinato import LLM, SamplingParams
from ostinato.tools.checkpoint import make_checkpoint

PROMPT = "Hello world"
MAX_TOKENS = 20


def with_extra_eos(src, dst, token_id: int):
    """A copy of checkpoint `src` in which token_id also ends a sequence."""
    shutil.copytree(src, dst)
    gen = dst / "generation_config.json"
    cfg = json.loads(gen.read_text())
    eos = cfg.get("eos_token_id")
    cfg["eos_token_id"] = (eos if isinstance(eos, list) else [eos] if eos is not None else []) + [token_id]
    gen.write_text(json.dumps(cfg))
    return dst


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, **kw)


@pytest.fixture(scope="module")
def eos_case(tmp_path_factory):
    """(checkpoint with the extra EOS, the free-running greedy tokens, the EOS token, where it first occurs)."""
    root = tmp_path_factory.mktemp("eos")
    base = make_checkpoint(root / "base", shape="tiny", family="llama", seed=1)
    free = LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)
    free_ids = free.generate([PROMPT], greedy(ignore_eos=True))[0].outputs[0].token_ids
    # Without ignore_eos the unchanged checkpoint runs to max_tokens: its own EOS ids never come up here,
    # so any earlier stop below is the new EOS token's doing.
    assert free.generate([PROMPT], greedy())[0].outputs[0].token_ids == free_ids
    eos = free_ids[MAX_TOKENS // 2]
    first = free_ids.index(eos)
    assert 0 < first < MAX_TOKENS - 1, free_ids
    path = with_extra_eos(base, root / "eos", eos)
    return path, free_ids, eos, first


@pytest.fixture(scope="module")
def eos_llm(eos_case):
    return LLM(str(eos_case[0]), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64)


def test_output_stops_on_the_eos_token(eos_llm, eos_case):
    _, free_ids, eos, first = eos_case
    out = eos_llm.generate([PROMPT], greedy())[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free_ids[: first + 1] and out.token_ids[-1] == eos


def test_ignore_eos_runs_past_it(eos_llm, eos_case):
    _, free_ids, _, _ = eos_case
    out = eos_llm.generate([PROMPT], greedy(ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids == free_ids


def test_eos_ends_each_sequence_of_a_batch_on_its_own(eos_llm, eos_case):
    _, free_ids, _, first = eos_case
    outs = eos_llm.generate([PROMPT, PROMPT], [greedy(), greedy(ignore_eos=True)])
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "length"]
    assert len(outs[0].outputs[0].token_ids) == first + 1 and outs[1].outputs[0].token_ids == free_ids
    st = eos_llm.engine.stats()
    assert st.kv_blocks_free == st.kv_blocks_total and st.num_running == st.num_waiting == 0
