"""Speculative decoding through the whole engine on CPU (a random tiny llama, fp32): the output with
--speculative-method ngram equals the output without it, greedy and seeded, across batch sizes, preemption
and prefix-cache hits; a sequence that ends inside an accepted run ends exactly there; nothing leaks.

A random model rarely repeats itself, so prompt lookup is mostly wrong on it: the tests that need long accepted
runs swap the proposer for an oracle that proposes the plain run's own continuation, corrupted at a fixed
pattern of positions (so runs are accepted whole, cut mid-way, and rejected at once)."""

import pytest

from ostinato import LLM, SamplingParams
from ostinato.errors import InvalidRequestError
from ostinato.tools.checkpoint import make_checkpoint
from support.graph_engine import recorded_graphs

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], list(range(10, 40)), [7, 7, 7, 7],
           [3, 4, 5, 6, 3, 4], [9, 8, 7, 9, 8, 7, 9, 8, 7, 9, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("spec-ckpt")
    make_checkpoint(path, shape="tiny", family="llama", seed=1)
    return str(path)


def make(ckpt, spec=True, **kw):
    args = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=96, block_size=4)
    args.update(kw)
    if spec:
        args.update(speculative_method="ngram", num_speculative_tokens=args.pop("k", 4))
    return LLM(ckpt, **args)


def tokens(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def assert_clean(llm):
    st = llm.engine.stats()
    assert st.num_running == st.num_waiting == 0 and st.kv_blocks_free == st.kv_blocks_total


class Oracle:
    """Proposes the plain run's continuation of a sequence, with the token at every third step's position
    (outputs so far + j) % 5 == 3 replaced by a wrong one."""

    def __init__(self, reference: dict[tuple[int, ...], list[int]], vocab: int):
        self.reference, self.vocab = reference, vocab

    def propose(self, seq, k):
        ref = self.reference[tuple(seq.prompt_token_ids)]
        done = len(seq.output_token_ids)
        out = list(ref[done:done + k])
        for j in range(len(out)):
            if (done + j) % 5 == 3:
                out[j] = (out[j] + 1) % self.vocab
                break
        return tuple(out)

    def forget(self, seq_id):
        pass


@pytest.fixture(scope="module")
def plain(ckpt):
    llm = make(ckpt, spec=False)
    return llm, tokens(llm.generate(PROMPTS, GREEDY))


def with_oracle(llm, prompts, ref):
    llm.engine.scheduler.proposer = Oracle({tuple(p): r[0] for p, r in zip(prompts, ref)},
                                           llm.engine.model_config.vocab_size)
    return llm


@pytest.mark.parametrize("max_num_seqs", [1, 8])
def test_greedy_output_is_unchanged_at_any_batch_size(ckpt, plain, max_num_seqs):
    llm = make(ckpt, max_num_seqs=max_num_seqs)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    assert llm.engine.stats().spec_decode_draft_tokens > 0  # ngram proposed (and was checked) on these prompts
    assert_clean(llm)


@pytest.mark.parametrize("k", [1, 5])
def test_greedy_output_is_unchanged_with_long_accepted_runs(ckpt, plain, k):
    llm = with_oracle(make(ckpt, k=k, max_num_seqs=4), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    st = llm.engine.stats()
    if k > 1:
        assert st.spec_decode_accepted_tokens > st.spec_decode_drafts  # runs longer than one token were accepted
    assert st.spec_decode_accepted_tokens < st.spec_decode_draft_tokens  # and some proposals rejected
    assert st.generation_tokens_total == sum(len(r[0]) for r in plain[1])
    assert_clean(llm)


def test_preemption_under_a_small_cache_keeps_the_output(ckpt, plain):
    llm = with_oracle(make(ckpt, num_kv_blocks=26, max_num_seqs=6), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    assert llm.engine.stats().num_preemptions > 0
    assert_clean(llm)


def test_prefix_cache_hits_keep_the_output(ckpt, plain):
    llm = with_oracle(make(ckpt), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    # Again, each prompt followed by its first generated tokens: the cache serves blocks that verify steps wrote.
    longer = [p + r[0][:12] for p, r in zip(PROMPTS, plain[1])]
    want = tokens(make(ckpt, spec=False).generate(longer, GREEDY))
    llm.engine.scheduler.proposer = Oracle({tuple(p): r[0] for p, r in zip(longer, want)}, 512)
    before = llm.engine.stats().prefix_cache_hits
    assert tokens(llm.generate(longer, GREEDY)) == want
    assert llm.engine.stats().prefix_cache_hits - before >= 4 * len(longer)
    assert_clean(llm)


def test_a_stop_inside_an_accepted_run_ends_exactly_there(ckpt, plain):
    """The oracle proposes past the stop token and max_tokens; the output still ends where the plain run's does."""
    ref = plain[1]
    stops = [r[0][6] for r in ref]
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[s]) for s in stops]
    params[2] = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    want = tokens(plain[0].generate(PROMPTS, params))
    llm = with_oracle(make(ckpt, k=7), PROMPTS, ref)
    got = llm.generate(PROMPTS, params)
    assert tokens(got) == want
    assert [o.outputs[0].finish_reason for o in got] == ["stop", "stop", "length", "stop", "stop", "stop"]
    assert_clean(llm)


def test_seeded_rows_give_the_tokens_and_logprobs_of_plain_decoding(ckpt, plain):
    params = SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True, logprobs=2, n=2)
    want = plain[0].generate(PROMPTS[:3], params)
    llm = with_oracle(make(ckpt), PROMPTS[:3], tokens(want))
    got = llm.generate(PROMPTS[:3], params)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        for gc, wc in zip(g.outputs, w.outputs):
            assert [t.logprob for t in gc.logprobs] == pytest.approx([t.logprob for t in wc.logprobs], abs=1e-4)
    assert llm.engine.stats().spec_decode_accepted_tokens > 0


FILTERED = [SamplingParams(temperature=0.8, seed=7, top_k=5, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=8, top_p=0.9, max_tokens=16, ignore_eos=True, logprobs=1)]


@pytest.mark.parametrize("proposer", ["oracle", "ngram"])
def test_seeded_top_k_and_top_p_rows_give_the_tokens_of_plain_decoding(ckpt, plain, proposer):
    """Verify position j re-draws a filtered row with counter num_generated + j, the counter plain decoding's
    re-draw after the replay uses for the same token. The oracle's runs are accepted over many positions; prompt
    lookup's proposals are checked and (with these samples) rejected."""
    want = tokens(plain[0].generate(PROMPTS[:2], FILTERED))
    llm = with_oracle(make(ckpt), PROMPTS[:2], want) if proposer == "oracle" else make(ckpt)
    assert tokens(llm.generate(PROMPTS[:2], FILTERED)) == want
    st = llm.engine.stats()
    assert st.spec_decode_draft_tokens > 0
    if proposer == "oracle":
        assert st.spec_decode_accepted_tokens > st.spec_decode_drafts  # runs longer than one token were accepted
    assert_clean(llm)


@pytest.mark.parametrize("params, param", [
    (SamplingParams(repetition_penalty=1.2), "repetition_penalty"),
    (SamplingParams(logit_bias={3: 1.0}), "logit_bias"),
    (SamplingParams(min_tokens=2), "min_tokens"),
])
def test_what_a_verify_step_cannot_apply_is_refused(ckpt, params, param):
    llm = make(ckpt)
    with pytest.raises(InvalidRequestError, match="--speculative-method") as e:
        llm.generate([[1, 2, 3]], params)
    assert e.value.param == param
    assert_clean(llm)


def test_verify_steps_replay_prefill_graphs_and_keep_the_output(ckpt, plain):
    """With prefill graphs (recorded, on CPU: the captured code run as it is), verify steps that fit a captured
    token count replay it, padded, and the output is still the plain run's."""
    with recorded_graphs((1, 4), prefill_sizes=(8, 16, 32), prefill_max_seqs=4):
        llm = with_oracle(make(ckpt, max_num_seqs=4), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    st = llm.engine.stats()
    assert st.prefill_steps_graph > 10 and st.prefill_padded_tokens > 0 and st.spec_decode_accepted_tokens > 0
    assert_clean(llm)


def test_a_stream_delivers_each_accepted_run_as_one_delta(ckpt, plain):
    llm = with_oracle(make(ckpt), PROMPTS[:1], plain[1][:1])
    chunks = list(llm.stream(PROMPTS[0], GREEDY))
    want = plain[0].generate(PROMPTS[:1], GREEDY)[0].outputs[0]
    assert [t for c in chunks for t in c.outputs[0].token_ids] == want.token_ids
    assert "".join(c.outputs[0].text for c in chunks) == want.text
    assert len(chunks) < len(want.token_ids) * 0.7  # several tokens per step: the runs were accepted


def test_chunked_prefill_beside_verify_rows_keeps_the_output(ckpt, plain):
    """A step budget of 12 tokens: prompts are prefilled in chunks beside the running verify rows, whose
    proposals are cut to what the budget leaves."""
    llm = with_oracle(make(ckpt, max_num_seqs=4, max_num_batched_tokens=12), PROMPTS, plain[1])
    assert tokens(llm.generate(PROMPTS, GREEDY)) == plain[1]
    assert llm.engine.stats().spec_decode_accepted_tokens > 0
    assert_clean(llm)
