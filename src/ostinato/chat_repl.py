"""`ostinato chat MODEL`: a terminal chat in the spirit of `ollama run`.

Tokens are printed as the engine produces them; the conversation is kept between turns and rendered by the
model's chat template each turn. `/exit` (or `/bye`) and Ctrl-D leave; Ctrl-C while a reply streams stops
that reply (what was printed stays in the conversation) and the chat goes on; `/clear` forgets the history.
A reply cut by --max-tokens ends with a ` [length]` marker. Sampling: the flags given, else the model's
generation defaults (--generation-config), else CHAT_DEFAULTS; each chat has a fresh random seed unless
--seed is given.

Ctrl-C during a reply only sets a flag, read between engine steps: an exception thrown into the middle of a
step could leave the scheduler and the runner disagreeing, so the reply is aborted cleanly at a step edge.
"""

from __future__ import annotations

import random
import signal
import sys
from typing import TextIO

from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import SamplingParams, with_defaults

PROMPT = ">>> "
EXIT_COMMANDS = ("/exit", "/bye", "/quit")
HELP = "/exit or Ctrl-D leaves, Ctrl-C stops a reply, /clear forgets the conversation"


def register(sub) -> None:
    from ostinato.cli_args import add_engine_args

    p = sub.add_parser("chat", help="chat with a model in the terminal (streams tokens, keeps the conversation)")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"longest reply, in tokens (default: the model's max_new_tokens, else "
                        f"{CHAT_DEFAULTS['max_tokens']})")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"0 is greedy (default: the model's, else {CHAT_DEFAULTS['temperature']})")
    p.add_argument("--top-p", type=float, default=None,
                   help=f"default: the model's, else {CHAT_DEFAULTS['top_p']}")
    p.add_argument("--top-k", type=int, default=None, help="default: the model's, else off")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help=f"default: the model's, else {CHAT_DEFAULTS['repetition_penalty']}")
    # Unless --seed is given, each chat draws from a fresh random seed: two chats give different replies.
    p.set_defaults(func=run, seed=None)


# What a chat samples with where neither the flags nor the model's generation_config.json say (vLLM's and
# Ollama's kind of chat defaults). SmolLM2's GGUF sets none, and at these it answers without looping.
CHAT_DEFAULTS = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 512, "repetition_penalty": 1.2}
_FLAGS = ("temperature", "top_p", "top_k", "max_tokens", "repetition_penalty")


def chat_params(args, model_defaults) -> SamplingParams:
    """The chat's SamplingParams: the flags given, else the model's defaults, else CHAT_DEFAULTS."""
    given = {name: getattr(args, name) for name in _FLAGS if getattr(args, name) is not None}
    return with_defaults(given, {**CHAT_DEFAULTS, **model_defaults})


def run(args) -> int:
    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine

    try:
        import readline  # noqa: F401  line editing and history for input(), where the platform has it
    except ImportError:
        pass
    if args.seed is None:
        args.seed = random.SystemRandom().getrandbits(63)
    engine = LLMEngine(engine_args_from(args))
    TerminalChat(engine, chat_params(args, engine.generation_defaults), system=args.system).loop()
    return 0


class TerminalChat:
    def __init__(self, engine, params, system: str | None = None, out: TextIO | None = None):
        self.engine, self.params = engine, params
        self.out = out or sys.stdout  # looked up per chat, not once at import (tests swap sys.stdout)
        self.start = [{"role": "system", "content": system}] if system else []
        self.history = list(self.start)
        self._turns = 0
        self._stop_requested = False

    def loop(self) -> None:
        self._write(f"Chatting with {self.engine.served_model_name} (decode graphs: {self.engine.graph_status}). "
                    f"{HELP}.\n")
        while True:
            try:
                line = input(PROMPT)
            except EOFError:  # Ctrl-D
                self._write("\n")
                return
            except KeyboardInterrupt:  # Ctrl-C at the prompt does not leave, as in ollama
                self._write(f"\n({HELP})\n")
                continue
            text = line.strip()
            if not text:
                continue
            if text in EXIT_COMMANDS:
                return
            if text == "/clear":
                self.history = list(self.start)
                self._write("(conversation cleared)\n")
                continue
            self.turn(text)

    def turn(self, user_text: str) -> str | None:
        """Send one user message, stream the reply, keep both in the history. None if it was refused."""
        from ostinato.engine.chat_prompt import render_chat

        self.history.append({"role": "user", "content": user_text})
        try:
            _, ids = render_chat(self.engine.tokenizer, self.history)
            request_id = f"chat-{self._turns}"
            self._turns += 1
            self.engine.add_request(request_id, ids, self.params)
        except InvalidRequestError as e:  # e.g. the conversation outgrew --max-model-len
            self.history.pop()
            self._write(f"error: {e}\n(/clear starts a new conversation)\n")
            return None
        reply = self._stream(request_id)
        self.history.append({"role": "assistant", "content": reply})
        return reply

    def _stream(self, request_id: str) -> str:
        printed = ""
        previous = signal.signal(signal.SIGINT, self._on_interrupt)
        self._stop_requested = False
        try:
            while True:
                if self._stop_requested:
                    self.engine.abort(request_id)
                    self._write(" [stopped]\n")
                    return printed
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    text = out.outputs[0].text  # everything so far (stop-string tails held back)
                    self._write(text[len(printed):])
                    printed = text
                    if out.finished:
                        # A reply cut by the token limit says so, as a marker outside the reply's text.
                        self._write(" [length]\n" if out.outputs[0].finish_reason == "length" else "\n")
                        return printed
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_interrupt(self, signum, frame) -> None:
        self._stop_requested = True

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
