"""`ostinato chat MODEL`: a terminal chat in the spirit of `ollama run`.

Tokens are printed as the engine produces them; the conversation is kept between turns and rendered by the
model's chat template each turn. `/exit` (or `/bye`) and Ctrl-D leave; Ctrl-C while a reply streams stops
that reply (what was printed stays in the conversation) and the chat goes on; `/clear` forgets the history.

Ctrl-C during a reply only sets a flag, read between engine steps: an exception thrown into the middle of a
step could leave the scheduler and the runner disagreeing, so the reply is aborted cleanly at a step edge.
"""

from __future__ import annotations

import signal
import sys
from typing import TextIO

from ostinato.errors import InvalidRequestError

PROMPT = ">>> "
EXIT_COMMANDS = ("/exit", "/bye", "/quit")
HELP = "/exit or Ctrl-D leaves, Ctrl-C stops a reply, /clear forgets the conversation"


def register(sub) -> None:
    from ostinato.cli_args import add_engine_args

    p = sub.add_parser("chat", help="chat with a model in the terminal (streams tokens, keeps the conversation)")
    add_engine_args(p)
    p.add_argument("--system", default=None, help="a system message that starts the conversation")
    p.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    # SmolLM2's model card suggests a low temperature; --temperature 0 is greedy.
    p.add_argument("--temperature", type=float, default=0.2)
    p.add_argument("--top-p", type=float, default=0.9)
    p.set_defaults(func=run)


def run(args) -> int:
    from ostinato.cli_args import engine_args_from
    from ostinato.engine.engine import LLMEngine
    from ostinato.sampling_params import SamplingParams

    try:
        import readline  # noqa: F401  line editing and history for input(), where the platform has it
    except ImportError:
        pass
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    engine = LLMEngine(engine_args_from(args))
    TerminalChat(engine, params, system=args.system).loop()
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
                        self._write("\n")
                        return printed
        finally:
            signal.signal(signal.SIGINT, previous)

    def _on_interrupt(self, signum, frame) -> None:
        self._stop_requested = True

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
