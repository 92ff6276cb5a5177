"""Speculative decoding with a draft model on the GPU (Triton attention; the draft's steps and the verify steps
as prefill-graph replays, or eager): fp32 greedy output equals plain decoding's with the model's own checkpoint
as draft (which then proposes the model's tokens) and with another seed's (mostly rejected), the draft's steps
replay its own graphs, sampled rows run, and every KV block is free afterwards."""

import pytest

from ostinato import LLM, SamplingParams
from ostinato.tools.checkpoint import make_checkpoint
from test_spec_engine import PROMPTS, tokens  # noqa: E402  (the CPU tests' prompts)

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {seed: str(make_checkpoint(tmp_path_factory.mktemp(f"gpu-draft-{seed}"), shape="tiny", family="llama",
                                      seed=seed)) for seed in (1, 2)}


def make(ckpts, draft=None, **kw):
    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=8, gpu_memory_utilization=0.3)
    args.update(kw)
    if draft is not None:
        args.update(speculative_method="draft", speculative_model=ckpts[draft], num_speculative_tokens=4)
    return LLM(ckpts[1], **args)


@pytest.fixture(scope="module")
def plain(ckpts):
    return tokens(make(ckpts).generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp32_greedy_equals_plain_decoding_with_the_models_own_checkpoint_as_draft(ckpts, plain, enforce_eager):
    llm = make(ckpts, draft=1, enforce_eager=enforce_eager)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    st = llm.engine.stats()
    # The draft's steps and the verify forward batch their rows differently; in fp32 their argmax agrees.
    assert st.spec_decode_accepted_tokens >= 0.95 * st.spec_decode_draft_tokens
    graphs = llm.engine.runner.draft.prefill_graphs  # None when the model's prefill graphs are off
    graph_steps = graphs.stats().graph_steps if graphs is not None else 0
    assert (graph_steps > 0) == (not enforce_eager)
    assert st.kv_blocks_free == st.kv_blocks_total


def test_fp32_greedy_equals_plain_decoding_with_a_mostly_wrong_draft(ckpts, plain):
    llm = make(ckpts, draft=2)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain
    st = llm.engine.stats()
    assert st.spec_decode_accepted_tokens < 0.2 * st.spec_decode_draft_tokens
    assert st.kv_blocks_free == st.kv_blocks_total


def test_sampled_rows_with_a_draft_run_to_their_length_and_free_their_blocks(ckpts):
    llm = make(ckpts, draft=2, dtype="bfloat16")
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True, n=2)
    out = llm.generate(PROMPTS, params)
    assert all(len(c.token_ids) == 24 for o in out for c in o.outputs)
    st = llm.engine.stats()
    assert st.kv_blocks_free == st.kv_blocks_total
