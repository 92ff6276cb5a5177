"""Engine and offline API on CPU: bad input gets typed errors that say what to change and loses nothing;
stop strings, stop tokens, seeds, n and logprobs behave as documented."""

import pytest

from ostinato import LLM, SamplingParams
from ostinato.config import EngineArgs
from ostinato.errors import ConfigError, InvalidRequestError, QueueFullError
from ostinato.tools.checkpoint import make_checkpoint
from support.tiny_llm import tiny_llm


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    return tiny_llm(tmp_path_factory, "engine-ckpt", num_kv_blocks=64, max_model_len=64, max_queued_requests=4)


def _assert_clean(llm):
    st = llm.engine.stats()
    assert st.num_running == st.num_waiting == 0 and st.kv_blocks_free == st.kv_blocks_total
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, param, hint", [
    (dict(temperature=-0.5), "temperature", ">= 0"),
    (dict(top_p=0.0), "top_p", "(0, 1]"),
    (dict(top_p=1.5), "top_p", "(0, 1]"),
    (dict(max_tokens=0), "max_tokens", ">= 1"),
    (dict(top_k=-3), "top_k", "-1 or 0"),
    (dict(logprobs=50), "logprobs", "[0, 20]"),
    (dict(n=0), "n", ">= 1"),
    (dict(stop=[""]), "stop", "non-empty"),
])
def test_invalid_sampling_params_name_the_parameter_and_the_range(kwargs, param, hint):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and hint in str(e.value)


@pytest.mark.parametrize("prompt, params, param, hint", [
    ("", SamplingParams(), "prompt", "empty"),
    ([], SamplingParams(), "prompt", "empty"),
    ([5] * 64, SamplingParams(), "prompt", "max_model_len is 64"),
    ([5] * 60, SamplingParams(max_tokens=10), "max_tokens", "at most 4"),
    ([5, 10 ** 6], SamplingParams(), "prompt", "token ids must be integers in [0,"),
])
def test_bad_prompts_are_refused_and_nothing_is_lost(llm, prompt, params, param, hint):
    with pytest.raises(InvalidRequestError) as e:
        llm.generate([prompt], params)
    assert e.value.param == param and hint in str(e.value)
    _assert_clean(llm)


def test_a_bad_prompt_in_a_batch_submits_none_of_it(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 6], [], [7]], SamplingParams(max_tokens=2))
    _assert_clean(llm)
    assert len(llm.generate([[5, 6], [7]], SamplingParams(max_tokens=2))) == 2


def test_queue_limit_is_a_typed_error_and_n_is_queued_whole(llm):
    eng = llm.engine
    eng.add_request("q1", [5, 6], SamplingParams(max_tokens=2))
    eng.add_request("q2", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(QueueFullError, match="--max-queued-requests"):
        eng.add_request("q3", [5, 6], SamplingParams(max_tokens=2, n=3))  # 2 + 3 > 4: nothing queued
    assert eng.scheduler.num_waiting == 2
    eng.abort("q1")
    eng.abort("q2")
    _assert_clean(llm)


def test_duplicate_request_id_is_refused(llm):
    eng = llm.engine
    eng.add_request("dup", [5], SamplingParams(max_tokens=1))
    with pytest.raises(InvalidRequestError, match="already in use"):
        eng.add_request("dup", [6], SamplingParams(max_tokens=1))
    eng.abort("dup")
    _assert_clean(llm)


def test_unknown_engine_argument_lists_the_valid_ones(tmp_path):
    with pytest.raises(ConfigError, match="unknown engine argument.*max_num_seqs"):
        LLM(str(tmp_path), max_num_seq=4)
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        EngineArgs(model="x", gpu_memory_utilization=1.5)


def test_stop_string_cuts_the_text_and_stop_token_ends_it(llm):
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    # Stop at a piece of the text the model is known to produce, spanning the middle of the output.
    text = free.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop and stop.strip(), text
    cut = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.index(stop)]
    kept = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]
    tok = free.token_ids[4]
    by_id = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                                     stop_token_ids=[tok]))[0].outputs[0]
    assert by_id.finish_reason == "stop" and by_id.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    _assert_clean(llm)


def test_seeded_sampling_repeats_whatever_the_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([[9, 8, 7]], p)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batched = llm.generate([[1, 2], [9, 8, 7], [4]], [other, p, other])[1].outputs[0].token_ids
    assert alone == batched
    assert llm.generate([[9, 8, 7]], SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=99,
                                                    ignore_eos=True))[0].outputs[0].token_ids != alone


def test_n_completions_and_logprobs(llm):
    out = llm.generate([[3, 4, 5]], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=6, logprobs=3,
                                                   ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # seed + index: different streams
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids) == 6 and c.finish_reason == "length"
        for tok, lp in zip(c.token_ids, c.logprobs):
            assert lp.token_id == tok and lp.logprob <= 0 and len(lp.top) == 3
            assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    _assert_clean(llm)


def test_the_server_caps_a_decoding_steps_prompt_tokens_the_offline_api_does_not_and_given_values_stay(
        llm, tmp_path):
    from ostinato.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_PREFILL_GRAPH_TOKENS, EngineArgs

    largest = DEFAULT_PREFILL_GRAPH_TOKENS[-1]
    offline = llm.engine.scheduler_config
    budget = max(DEFAULT_MAX_NUM_BATCHED_TOKENS, offline.max_num_seqs)
    assert (offline.max_num_batched_tokens, offline.max_prefill_tokens_while_decoding) == (budget, budget)
    make_checkpoint(tmp_path, shape="tiny", family="llama", seed=1)
    given = LLM(str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=16, max_model_len=64,
                max_num_seqs=4, max_num_batched_tokens=32, max_prefill_tokens_while_decoding=8)
    assert (given.engine.scheduler_config.max_num_batched_tokens,
            given.engine.scheduler_config.max_prefill_tokens_while_decoding) == (32, 8)
    # The engine's own defaults (the server's): the same budget, the cap leaving the decode rows room in the
    # largest prefill graph, and at least half that graph where many sequences decode.
    model_config = given.engine.model_config
    for seqs, cap in ((64, largest - 64), (256, largest // 2), (1024, largest // 2)):
        server = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=seqs)
        sched = server.scheduler_config(model_config)
        assert (sched.max_num_batched_tokens, sched.max_prefill_tokens_while_decoding) == (
            max(DEFAULT_MAX_NUM_BATCHED_TOKENS, seqs), cap)
    # The largest prefill graph the flags leave sets it: graphs of at most 128 tokens, room for 128 - 4 prompt ones.
    small = EngineArgs(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=64, max_num_seqs=4,
                       prefill_graph_tokens=(64, 128))
    assert small.scheduler_config(model_config).max_prefill_tokens_while_decoding == 124


def test_seeded_top_k_and_top_p_rows_draw_the_same_tokens_after_a_preemption(tmp_path_factory):
    """A recomputed sequence draws its next token in a prefill step, with counter num_generated; every other
    token comes from a decode step, whose top-k / top-p re-draw must use the same counter for it (on a CPU the
    decode rows it reads are the very rows the step advances)."""
    prompts = [[5, 6, 7, 8, 9, 5], [1, 2, 3, 1], list(range(10, 30)), [7, 7, 7], [3, 4, 5, 6], [9, 8, 7, 9]]
    params = [SamplingParams(temperature=0.8, seed=s, top_k=5, top_p=0.95 if s % 2 else 1.0, max_tokens=20,
                             ignore_eos=True) for s in range(len(prompts))]
    roomy = tiny_llm(tmp_path_factory, "preempt-ckpt", num_kv_blocks=64, max_model_len=64, block_size=4)
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params)]
    tight = tiny_llm(tmp_path_factory, "preempt-ckpt", num_kv_blocks=20, max_model_len=64, block_size=4)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.stats().num_preemptions > 0
    _assert_clean(tight)
