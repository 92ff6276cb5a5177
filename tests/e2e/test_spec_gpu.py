"""Speculative decoding on the GPU (Triton attention, decode-graph replays for the verify steps): fp32 greedy
output equals plain decoding's on a random model (with an oracle proposer, so long runs are accepted) and on
SmolLM2 (prompt lookup); graph and eager verify steps agree; bf16 stays logprob-close to plain decoding up to
the first divergence."""

import pytest
from test_gpu_e2e import TOP, close_until_divergence

from ostinato import LLM, SamplingParams
from ostinato.tools.checkpoint import make_checkpoint
from test_spec_engine import PROMPTS, Oracle, tokens  # noqa: E402  (the CPU tests' prompts and oracle)

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu-spec")
    make_checkpoint(path, shape="tiny", family="llama", seed=1)
    return str(path)


def make(path, spec=True, k=4, **kw):
    args = dict(dtype="float32", max_model_len=256, num_kv_blocks=256, max_num_seqs=8, gpu_memory_utilization=0.3)
    args.update(kw)
    if spec:
        args.update(speculative_method="ngram", num_speculative_tokens=k)
    return LLM(path, **args)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_fp32_greedy_equals_plain_decoding_on_graph_and_eager_verify_steps(ckpt, enforce_eager):
    want = tokens(make(ckpt, spec=False).generate(PROMPTS, GREEDY))
    llm = make(ckpt, enforce_eager=enforce_eager)
    llm.engine.scheduler.proposer = Oracle({tuple(p): r[0] for p, r in zip(PROMPTS, want)}, 512)
    assert tokens(llm.generate(PROMPTS, GREEDY)) == want
    st = llm.engine.stats()
    assert st.spec_decode_accepted_tokens > st.spec_decode_drafts
    # Verify steps replay decode graphs (the prompts' prefill steps take the prefill path)
    assert (llm.engine.runner.verifier.steps_by_path["decode graph"] > 0) == (not enforce_eager)
    # Row j reads the K/V rows 0 .. j - 1 write in the same layer: RoPE and the K/V write stay in their own kernel
    assert not llm.engine.runner.backend.decode_applies_rope
    assert st.kv_blocks_free == st.kv_blocks_total


def test_smollm2_ngram_fp32_greedy_equals_plain_decoding():
    from test_spec_smollm2 import PROMPTS as REPEATING

    params = SamplingParams(temperature=0.0, max_tokens=64)
    want = tokens(make("smollm2-135m", spec=False, max_model_len=1024).generate(REPEATING, params))
    llm = make("smollm2-135m", max_model_len=1024)
    assert tokens(llm.generate(REPEATING, params)) == want
    assert llm.engine.stats().spec_mean_accepted_length > 1.2


def test_bf16_stays_logprob_close_to_plain_decoding(ckpt):
    """In bf16 a verified token is computed in a batch of another shape than a decoded one, RoPE in its own
    kernel: their logits differ in the last bits, so greedy may flip where two logits tie. Up to the first divergence
    every token matches and the logprobs are close (test_gpu_e2e.close_until_divergence)."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=TOP)
    plain = make(ckpt, spec=False, dtype="bfloat16").generate(PROMPTS, params)
    llm = make(ckpt, dtype="bfloat16")
    llm.engine.scheduler.proposer = Oracle({tuple(p): r[0] for p, r in zip(PROMPTS, tokens(plain))}, 512)
    spec = llm.generate(PROMPTS, params)
    compared = sum(close_until_divergence(a.outputs[0].token_ids, a.outputs[0].logprobs, b.outputs[0].token_ids,
                                          b.outputs[0].logprobs) for a, b in zip(spec, plain))
    assert compared >= 60
