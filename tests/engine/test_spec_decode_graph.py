"""Verify steps through the decode graphs (runner/verify_rows.py, SpecVerifier.replay_flattened) on CPU: the
decode graphs recorded (RecordingGraphBackend runs the captured code as it is), a random tiny llama in fp32.

A step of verify rows only replays the decode graph its flattened rows fit, sampling inside; the output equals
plain decoding's across batch sizes, padding, prefix-cache hits, seeded / top-k / logprobs rows and a draft
model, and a step the graphs cannot hold (prompt chunks beside it, more rows than the largest graph) takes the
prefill path."""

import numpy as np
import pytest

from ostinato import SamplingParams
from ostinato.config import EngineArgs
from ostinato.contract import ScheduledSeq
from ostinato.runner.sampling_state import BLOCKS, CTR, POS, TOKEN
from ostinato.runner.verify_rows import flatten_verify_rows
from ostinato.tools.checkpoint import make_checkpoint
from support.graph_engine import recorded_graphs
from test_spec_engine import GREEDY, PROMPTS, Oracle, assert_clean, make, tokens, with_oracle

SIZES = (1, 2, 4, 8, 16, 24, 48)  # 6 sequences x 5 rows fit 48; most steps pad


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec-graph-ckpt")
    make_checkpoint(path, shape="tiny", family="llama", seed=1)
    return str(path)


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = make(ckpt, spec=False)
    return llm, tokens(llm.generate(PROMPTS, GREEDY))


def graph_llm(ckpt, sizes=SIZES, **kw):
    with recorded_graphs(sizes):
        return make(ckpt, **kw)


def paths(llm) -> dict[str, int]:
    return llm.engine.runner.verifier.steps_by_path


def assert_decode_graph_path(llm):
    """Verify steps replayed decode graphs (each replay one step of the decode-graph path), padded, and the
    prefill path ran only the steps with prompt chunks (at most one per admitted prompt)."""
    graphs = llm.engine.runner.graphs.stats
    steps = paths(llm)
    assert steps["decode graph"] > 0 and sum(graphs.replays_by_size.values()) == steps["decode graph"]
    assert graphs.eager_steps == 0 and graphs.padded_rows > 0
    assert steps["prefill"] <= len(PROMPTS)


@pytest.mark.parametrize("max_num_seqs", [1, 3, 6])
def test_greedy_verify_steps_replay_decode_graphs_and_keep_the_output(ckpt, plain, max_num_seqs):
    llm = with_oracle(graph_llm(ckpt, max_num_seqs=max_num_seqs), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    st = llm.engine.stats()
    assert st.spec_decode_accepted_tokens > st.spec_decode_drafts  # runs longer than one token were accepted
    assert st.spec_decode_accepted_tokens < st.spec_decode_draft_tokens  # and some proposals rejected
    assert_decode_graph_path(llm)
    assert_clean(llm)


def test_prompt_lookup_through_decode_graphs_keeps_the_output(ckpt, plain):
    llm = graph_llm(ckpt, max_num_seqs=6)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    assert llm.engine.stats().spec_decode_draft_tokens > 0
    assert_decode_graph_path(llm)
    assert_clean(llm)


def test_prefix_cache_hits_through_decode_graphs_keep_the_output(ckpt, plain):
    llm = with_oracle(graph_llm(ckpt), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    longer = [p + r[0][:12] for p, r in zip(PROMPTS, plain[1])]
    want = tokens(plain[0].generate(longer, GREEDY))
    llm.engine.scheduler.proposer = Oracle({tuple(p): r[0] for p, r in zip(longer, want)}, 512)
    before = llm.engine.stats().prefix_cache_hits
    assert tokens(llm.generate(longer, GREEDY)) == want
    assert llm.engine.stats().prefix_cache_hits - before >= 4 * len(longer)
    assert_decode_graph_path(llm)
    assert_clean(llm)


def test_seeded_and_logprobs_rows_give_the_tokens_of_plain_decoding(ckpt, plain):
    """Drawn in the graph (temperature, seed), logprobs finished after it."""
    params = [SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True, logprobs=2, n=2),
              SamplingParams(temperature=0.7, seed=9, max_tokens=16, ignore_eos=True)]
    want = plain[0].generate(PROMPTS[:2], params)
    llm = with_oracle(graph_llm(ckpt), PROMPTS[:2], tokens(want))
    got = llm.generate(PROMPTS[:2], params)
    assert tokens(got) == tokens(want)
    for gc, wc in zip(got[0].outputs, want[0].outputs):
        assert [t.logprob for t in gc.logprobs] == pytest.approx([t.logprob for t in wc.logprobs], abs=1e-4)
    assert llm.engine.stats().spec_decode_accepted_tokens > 0
    assert paths(llm)["decode graph"] > 0
    assert_clean(llm)


def test_top_k_and_top_p_rows_draw_as_on_the_prefill_path(ckpt, plain):
    """Re-drawn after the replay as the prefill path draws them: the same tokens whichever path verified, and
    those of plain decoding."""
    params = [SamplingParams(temperature=0.8, seed=7, top_k=5, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=8, top_p=0.9, max_tokens=16, ignore_eos=True)]
    reference = tokens(plain[0].generate(PROMPTS[:2], params))
    want = tokens(with_oracle(make(ckpt), PROMPTS[:2], reference).generate(PROMPTS[:2], params))
    assert want == reference
    llm = with_oracle(graph_llm(ckpt), PROMPTS[:2], reference)
    assert tokens(llm.generate(PROMPTS[:2], params)) == want
    assert llm.engine.stats().spec_decode_accepted_tokens > 0 and paths(llm)["decode graph"] > 0
    assert_clean(llm)


def test_steps_the_graphs_cannot_hold_take_the_prefill_path(ckpt, plain):
    """Graphs of at most 4 rows, six sequences of 5 rows each: no step fits, every one falls back, same output."""
    llm = with_oracle(graph_llm(ckpt, sizes=(1, 2, 4), k=4, max_num_seqs=6), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    assert paths(llm)["prefill"] > 0 and paths(llm)["decode graph"] == 0
    assert llm.engine.runner.graphs.stats.graph_steps == 0
    assert_clean(llm)


def test_a_draft_models_proposals_are_verified_through_decode_graphs(ckpt, plain):
    """The target's own checkpoint as the draft: every proposal is accepted, greedy and sampled (the draft's
    rejection sampling runs after the replay)."""
    llm = graph_llm(ckpt, spec=False, speculative_method="draft", speculative_model=ckpt, num_speculative_tokens=3)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    llm.generate(PROMPTS, sampled)
    st = llm.engine.stats()
    assert st.spec_decode_accepted_tokens == st.spec_decode_draft_tokens > 0
    assert paths(llm)["decode graph"] > 0
    assert_clean(llm)


def test_flattened_rows_hold_each_position_its_token_counter_and_table():
    seqs = (ScheduledSeq(3, (11, 12, 13), 9, (4, 5, 6), SamplingParams(temperature=0), 2, verify=True),
            ScheduledSeq(8, (21,), 5, (7, 8), SamplingParams(temperature=0.5, top_k=3), 0, verify=True))
    flat = flatten_verify_rows(seqs, engine_seed=0, scratch_block=99)
    rows = flat.rows
    assert rows[:, TOKEN].tolist() == [11, 12, 13, 21]
    assert rows[:, POS].tolist() == [9, 10, 11, 5]  # context lengths 10, 11, 12, 6: each row sees its own token
    assert rows[:, CTR].tolist() == [2, 3, 4, 0]
    assert rows[:, BLOCKS:].tolist() == [[4, 5, 6]] * 3 + [[7, 8, 99]]
    assert flat.any_filtered and flat.num_logprobs is None
    np.testing.assert_array_equal(rows[0, :BLOCKS][[i for i in range(BLOCKS) if i not in (TOKEN, POS, CTR)]],
                                  rows[2, :BLOCKS][[i for i in range(BLOCKS) if i not in (TOKEN, POS, CTR)]])


def test_decode_graphs_are_planned_for_k_plus_one_rows_a_sequence():
    plain = EngineArgs("m", max_num_seqs=8).graph_config(device_is_cuda=True)
    spec = EngineArgs("m", max_num_seqs=8, speculative_method="ngram", num_speculative_tokens=4).graph_config(True)
    assert max(plain.capture_sizes) == 8 and max(spec.capture_sizes) == 40


def test_the_verify_profile_labels_the_decode_graph_path(ckpt):
    import random

    from ostinato.tools.bench.spec import verify_step
    from ostinato.tools.bench.verify_profile import DECODE_GRAPH_LABELS, profile_verify

    llm = graph_llm(ckpt, max_model_len=64)
    out = verify_step(llm.engine.runner, 2, 8, 3, random.Random(0))
    host_us = profile_verify(llm.engine.runner.verifier, out, 2)["host_us"]
    assert set(DECODE_GRAPH_LABELS) <= set(host_us) and "verify: forward" not in host_us
