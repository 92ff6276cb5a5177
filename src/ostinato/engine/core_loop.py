"""The engine core process's side of core_process.py: the loop that owns the engine, applies the front's commands
between steps and sends each step's outputs (core_process.py describes the protocol).

Outputs leave through a sender thread (engine/core_link.py): the loop never waits on the front, and the steps
that queued while the front was busy reach it as one message.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from ostinato.config import EngineArgs, ModelConfig
from ostinato.engine.core_link import CommandSender
from ostinato.engine.core_logging import log_like_the_front
from ostinato.engine.incident import report_step_failure
from ostinato.engine.startup_heap import freeze_startup_heap

if TYPE_CHECKING:
    from ostinato.engine.engine import LLMEngine

logger = logging.getLogger("ostinato.engine.core_process")  # the core's lines keep the name they always had


@dataclass(frozen=True)
class EngineInfo:
    """What the server may read of the engine, sent by the core once it is loaded (AsyncEngine.engine gives an
    LLMEngine, which has the same attributes). graph_status is as of start-up."""

    args: EngineArgs
    tokenizer: object
    model_config: ModelConfig
    scheduler_config: object
    served_model_name: str
    graph_status: str
    generation_defaults: dict  # the model's sampling defaults (LLMEngine.generation_defaults)


def build_engine(args: EngineArgs) -> "LLMEngine":
    """The default engine factory (a module-level function, so `spawn` can pickle it by name)."""
    from ostinato.engine.engine import LLMEngine

    return LLMEngine(args)


def core_main(factory: Callable[[EngineArgs], "LLMEngine"], args: EngineArgs, commands, events,
              logging_setup: tuple[int, logging.Formatter | None] | None = None) -> None:
    """The engine core's loop: apply commands between steps, step while anything is unfinished, send outputs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server stops us in order
    if logging_setup is not None:
        log_like_the_front(*logging_setup)
    try:
        engine = factory(args)
    except BaseException as e:
        events.send(("dead", f"engine start-up failed: {type(e).__name__}: {e}"))
        return
    freeze_startup_heap()  # the loaded engine, out of every later collection's walk (startup_heap.py says why)
    # A thread blocks on the pipe so the loop checks for commands with a queue's cheap empty() instead of a
    # poll system call (and a selector object) every step.
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_pump, args=(commands, inbox), name="ostinato-core-commands", daemon=True).start()
    out = CommandSender(events, name="ostinato-core-outputs", batch=True)  # a slow front never stalls a step
    try:
        _serve(engine, args, inbox, out)
    finally:
        out.close(timeout=10)  # what is queued (a "dead" message above all) reaches the front before the exit


def _serve(engine: "LLMEngine", args: EngineArgs, inbox: queue.SimpleQueue, events: CommandSender) -> None:
    """Apply commands between steps, step while anything is unfinished, send each step's outputs."""
    # The engine's own tokenizer and configs, so the server formats with exactly what the engine uses.
    events.send(("ready", EngineInfo(args, engine.tokenizer, engine.model_config,
                                     engine.scheduler_config, engine.served_model_name, engine.graph_status,
                                     engine.generation_defaults)))
    while True:
        # Block for a command only when idle; otherwise take what has arrived and step.
        while not inbox.empty() or not engine.has_unfinished():
            message = inbox.get()
            kind = message[0]
            if kind == "stop":
                return
            if kind == "add":
                _, request_id, prompt, params = message
                try:
                    prompt_token_ids = engine.add_request(request_id, prompt, params)
                except Exception as e:  # a typed error the client gets back (InvalidRequestError, QueueFullError)
                    events.send(("added", request_id, None, e))
                    continue
                events.send(("added", request_id, prompt_token_ids, None))
            elif kind == "abort":
                engine.abort(message[1])
            elif kind == "stats":
                events.send(("stats", message[1], engine.stats()))
        try:
            records = engine.step_records()
        except BaseException:
            events.send(("dead", report_step_failure(logger, "engine step failed")))
            return
        if records:  # plain tuples (engine/step_outputs.py); the prompt went out once, with "added"
            events.send(("step", records, time.monotonic()))


def _pump(commands, inbox: queue.SimpleQueue) -> None:
    """Move commands from the pipe to the loop's queue; a closed pipe (the server is gone) stops the core."""
    try:
        while True:
            inbox.put(commands.recv())
    except (EOFError, OSError):
        inbox.put(("stop",))
