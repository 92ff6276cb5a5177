"""Speculative decoding (ngram) on the real SmolLM2-135M, CPU fp32: on prompts that ask to repeat a text, prompt
lookup proposes and some proposals are accepted, and the output equals the output without speculation, greedy
and seeded."""

import pytest

from ostinato import LLM, SamplingParams
from test_smollm2 import MODEL, cache_env, llm, report  # noqa: F401  (the shared model fixtures)

TEXT = "The quick brown fox jumps over the lazy dog. All that glitters is not gold."
PROMPTS = [f"Repeat this text exactly: {TEXT}\nRepeated text: {TEXT[:24]}",
           "Copy: one two three four five six. Copy: one two"]


@pytest.mark.slow
def test_ngram_leaves_the_output_unchanged_and_accepts_on_a_repeating_prompt(llm):  # noqa: F811
    spec = LLM(MODEL, dtype="float32", device="cpu", max_model_len=512, num_kv_blocks=128, max_num_seqs=8,
               speculative_method="ngram", num_speculative_tokens=4)
    for prompts, params in ((PROMPTS, SamplingParams(temperature=0, max_tokens=16)),
                            (PROMPTS[:1], SamplingParams(temperature=0.8, seed=3, max_tokens=12))):
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    st = spec.engine.stats()
    assert st.spec_decode_accepted_tokens > 0 and st.spec_mean_accepted_length > 1.2, st
    assert st.kv_blocks_free == st.kv_blocks_total
