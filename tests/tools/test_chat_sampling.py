"""`ostinato chat`'s sampling: the flags given, else the model's generation defaults, else CHAT_DEFAULTS; a
fresh random engine seed per chat unless --seed is given; a reply cut by --max-tokens ends with [length]."""

import io

import pytest

from ostinato import chat_repl
from ostinato.chat_repl import CHAT_DEFAULTS, TerminalChat, chat_params
from ostinato.cli import build_parser
from ostinato.config import EngineArgs
from ostinato.engine.engine import LLMEngine
from ostinato.sampling_params import SamplingParams
from ostinato.tools.checkpoint import make_checkpoint


def parse(*flags):
    return build_parser().parse_args(["chat", "some-model", *flags])


def test_flags_then_model_defaults_then_chat_defaults():
    assert chat_params(parse(), {}) == SamplingParams(**CHAT_DEFAULTS)
    model = {"temperature": 0.3, "top_k": 20, "max_tokens": 100}
    p = chat_params(parse(), model)
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0.3, 20, 100, CHAT_DEFAULTS["top_p"])
    p = chat_params(parse("--temperature", "0", "--max-tokens", "7", "--repetition-penalty", "1"), model)
    assert (p.temperature, p.max_tokens, p.repetition_penalty, p.top_k) == (0.0, 7, 1.0, 20)


def test_each_chat_gets_a_fresh_seed_unless_one_is_given(monkeypatch):
    seeds = []

    class FakeEngine:
        generation_defaults = {}

        def __init__(self, args):
            seeds.append(args.seed)

    monkeypatch.setattr("ostinato.engine.engine.LLMEngine", FakeEngine)
    monkeypatch.setattr(chat_repl.TerminalChat, "loop", lambda self: None)
    for flags in ((), (), ("--seed", "5")):
        args = parse(*flags)
        args.func(args)
    assert seeds[0] != seeds[1] and seeds[2] == 5


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", shape="tiny", family="llama", seed=1)
    return LLMEngine(EngineArgs(model=str(path), device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=64))


def test_a_reply_cut_by_the_token_limit_ends_with_the_length_marker(engine):
    out = io.StringIO()
    chat = TerminalChat(engine, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), out=out)
    reply = chat.turn("hello")
    assert out.getvalue() == reply + " [length]\n"
    assert chat.history[-1] == {"role": "assistant", "content": reply}  # the marker is not part of the reply
