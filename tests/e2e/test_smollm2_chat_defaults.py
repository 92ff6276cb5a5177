"""`ostinato chat` on the real SmolLM2 with its defaults (its GGUF sets none, so CHAT_DEFAULTS): the first
reply to the README's question does not loop, over several seeds, and at temperature 0 it names Paris."""

import collections

from test_smollm2 import cache_env, llm, report  # noqa: F401  (the shared model fixtures)
from ostinato.chat_repl import CHAT_DEFAULTS, chat_params
from ostinato.cli import build_parser
from ostinato.sampling_params import SamplingParams

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SEEDS = range(3)
REPLY_TOKENS = 64


def worst_4gram(ids: list[int]) -> int:
    """How often the most repeated run of 4 tokens occurs."""
    counts = collections.Counter(tuple(ids[i:i + 4]) for i in range(len(ids) - 3))
    return max(counts.values(), default=0)


def chat_defaults(llm, *flags) -> SamplingParams:
    args = build_parser().parse_args(["chat", "smollm2-135m", *flags])
    return chat_params(args, llm.engine.generation_defaults)


def test_the_first_reply_does_not_loop_at_the_chat_defaults(llm):
    params = chat_defaults(llm)
    assert llm.engine.generation_defaults == {} and params == SamplingParams(**CHAT_DEFAULTS)
    # 64 tokens a reply: the loop this guards against ("la Femme, la Femme, ...") starts within the first
    # sentences (temperature 0.2 and no repetition penalty repeat a 4-gram many times in 64 tokens), and each
    # token past that costs CPU seconds of the suite's budget.
    outs = llm.chat([QUESTION] * len(SEEDS), [params.replace(seed=s, max_tokens=REPLY_TOKENS) for s in SEEDS])
    replies = [o.outputs[0] for o in outs]
    for r in replies:
        assert worst_4gram(r.token_ids) <= 2, r.text
    assert len({tuple(r.token_ids) for r in replies}) > 1  # the seeds give different replies


def test_at_temperature_0_it_names_paris(llm):
    out = llm.chat(QUESTION, chat_defaults(llm, "--temperature", "0", "--max-tokens", "256"))[0].outputs[0]
    assert "Paris" in out.text and worst_4gram(out.token_ids) <= 2
