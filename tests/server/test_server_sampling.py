"""The sampling parameters clients send by default in many frameworks, through the official `openai` client:
frequency_penalty, presence_penalty and logit_bias (and vLLM's repetition_penalty, min_p, min_tokens and
bad_words in extra_body) get 200 and their effect, the same tokens the engine gives offline for the same
SamplingParams. And what a request leaves unset takes the model's defaults (sampling_params.with_defaults)."""

from __future__ import annotations

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("fastapi")

from test_server import MODEL, run_offline, server, engine, reference, checkpoint  # noqa: F401  (fixtures)
from ostinato.sampling_params import SamplingParams
from ostinato.server.protocol import ChatCompletionRequest, CompletionRequest

PROMPT = "The quick brown fox"


def offline_ids(reference, **kw):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, **kw})
    return run_offline(reference, PROMPT, params).outputs[0].text


def test_penalties_and_logit_bias_get_200_and_the_offline_tokens(server, reference):
    client = server.client()
    kw = dict(frequency_penalty=0.7, presence_penalty=0.4, logit_bias={"17": 6.0, "40": -100.0})
    result = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=12,
                                       extra_body={"ignore_eos": True}, **kw)
    want = offline_ids(reference, frequency_penalty=0.7, presence_penalty=0.4, logit_bias={17: 6.0, 40: -100.0})
    assert result.choices[0].text == want
    assert want != offline_ids(reference)  # the parameters changed this output


def test_logit_bias_plus_100_forces_the_token(server, reference):
    token = 77
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0.8, seed=3,
        max_completion_tokens=6, logit_bias={str(token): 100}, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    piece = reference.tokenizer.decode([token])
    assert [lp.token for lp in chat.choices[0].logprobs.content] == [piece] * 6


def test_vllm_extensions_in_extra_body(server, reference):
    extra = {"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 2}
    result = server.client().completions.create(model=MODEL, prompt=PROMPT, temperature=0.0, max_tokens=12,
                                                extra_body=extra)
    assert result.choices[0].text == offline_ids(reference, repetition_penalty=1.3, min_p=0.05, min_tokens=2)


# ---- the model's defaults, at the protocol: no server needed -----------------------------------------------
DEFAULTS = {"temperature": 0.6, "top_p": 0.8, "repetition_penalty": 1.1, "max_tokens": 40}


def test_unset_fields_take_the_model_defaults_and_set_ones_win():
    p = CompletionRequest(prompt="x").to_sampling_params(DEFAULTS)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.8, 1.1, 40)
    p = CompletionRequest(prompt="x", temperature=1.0, max_tokens=3, repetition_penalty=1.0).to_sampling_params(
        DEFAULTS)
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens) == (1.0, 0.8, 1.0, 3)
    # Without model defaults: SamplingParams' own, and OpenAI's 16 tokens for completions.
    p = CompletionRequest(prompt="x").to_sampling_params({})
    assert (p.temperature, p.top_p, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 1.0, 16)


def test_chat_max_tokens_default_is_capped_by_the_window_and_max_completion_tokens_wins():
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert ChatCompletionRequest(**body).to_sampling_params(10, 30, DEFAULTS).max_tokens == 20
    assert ChatCompletionRequest(**body).to_sampling_params(10, 100, DEFAULTS).max_tokens == 40
    assert ChatCompletionRequest(**body).to_sampling_params(10, 100, {}).max_tokens == 90
    req = ChatCompletionRequest(**body, max_tokens=7, max_completion_tokens=5)
    assert req.to_sampling_params(10, 100, DEFAULTS).max_tokens == 5
