"""`ostinato serve MODEL ...`: the command that reads the flags and runs the HTTP server (server/app.py).

Apart from the server because the flags are the CLI's (cli_args): the server package takes EngineArgs, not
argparse namespaces.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from ostinato.cli_args import add_engine_args, engine_args_from
from ostinato.config import SERVER_MAX_QUEUED_REQUESTS, default_served_model_name
from ostinato.errors import ConfigError
from ostinato.engine.async_engine import AsyncEngine
from ostinato.engine.core_process import ProcessAsyncEngine, build_engine
from ostinato.engine.startup_heap import freeze_startup_heap
from ostinato.server import app
from ostinato.server.limits import add_limit_args, limits_from
from ostinato.server.middleware import read_api_keys
from ostinato.server.shutdown import DrainingServer

logger = logging.getLogger("ostinato.server.app")  # the server's start-up lines keep their logger's name


DEFAULT_STALL_TIMEOUT_S = 60.0  # a step, or a compile in service, is far shorter; a hung core is not
DEFAULT_KILL_TIMEOUT_S = 120.0
# The drain, the engine's stop and uvicorn's last grace fit in Kubernetes' default 30 s before its SIGKILL.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
EVENT_LOOPS = ("auto", "uvloop", "asyncio")  # --loop (event_loop_factory)


def register(subparsers) -> None:
    """Add `ostinato serve MODEL_DIR ...` to the CLI."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=app.__doc__.split("\n\n")[0])
    add_engine_args(p, max_queued_requests=SERVER_MAX_QUEUED_REQUESTS)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", action="append", metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1/*; repeat it for several keys "
                        "(default: $OSTINATO_API_KEY)")
    p.add_argument("--api-keys-file", metavar="PATH",
                   help="more keys, one per line ('#' starts a comment line)")
    p.add_argument("--shared-prefix-cache", action="store_true",
                   help="let every API key share one prefix cache (default: each key has its own, so a client "
                        "cannot learn what a holder of another key sent from cached_tokens or from timing)")
    p.add_argument("--no-report-cached-tokens", dest="report_cached_tokens", action="store_false",
                   help="leave usage.prompt_tokens_details.cached_tokens out of responses")
    add_limit_args(p)
    p.add_argument("--engine-stall-timeout", type=_seconds_or_none, default=DEFAULT_STALL_TIMEOUT_S, metavar="S",
                   help="report the engine core 'stalled' (/health 503, new requests 503) once it has made no "
                        f"progress for S seconds while work is pending; 'none' turns it off "
                        f"(default: {DEFAULT_STALL_TIMEOUT_S:g})")
    p.add_argument("--engine-kill-timeout", type=_seconds_or_none, default=DEFAULT_KILL_TIMEOUT_S, metavar="S",
                   help="kill an engine core that has made no progress for S seconds while work is pending, and "
                        "exit 1 as for a dead core (at least --engine-stall-timeout; 'none' turns it off; "
                        f"default: {DEFAULT_KILL_TIMEOUT_S:g})")
    p.add_argument("--shutdown-timeout", type=_non_negative_seconds, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S",
                   help="on SIGTERM or Ctrl-C, let requests in flight finish for at most S seconds, then end the "
                        f"rest with an error event; /health says 503 draining meanwhile (default: "
                        f"{DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    p.add_argument("--loop", choices=EVENT_LOOPS, default="auto",
                   help="the front's event loop: uvloop (libuv, in C) writes each streamed chunk with less CPU "
                        "than asyncio's own loop; auto takes uvloop where it is installed (default: auto)")
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of in its own process "
                        "(slower: the engine and the HTTP work then share one GIL)")
    p.set_defaults(func=run)


def _non_negative_seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 seconds, got {text}")
    return value


def _seconds_or_none(text: str) -> float | None:
    if text.lower() == "none":
        return None
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds or 'none', got {text}")
    return value


def api_keys_from(ns: argparse.Namespace) -> list[str]:
    """The keys /v1/* accepts: every --api-key, then the keys file's; $OSTINATO_API_KEY when neither is given."""
    keys = list(ns.api_key or ())
    if ns.api_keys_file:
        keys += read_api_keys(ns.api_keys_file)
    if not keys and os.environ.get("OSTINATO_API_KEY"):
        keys.append(os.environ["OSTINATO_API_KEY"])
    return keys


def event_loop_factory(choice: str):
    """The loop factory for --loop: uvloop's where asked for or, with auto, installed; None for asyncio's own."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("--loop uvloop: uvloop is not installed (pip install uvloop), or use --loop asyncio")
        return None
    return uvloop.new_event_loop


class HoldUntilReady(logging.Filter):
    """Holds back uvicorn's "Uvicorn running on ..." line until the model is ready: the port answers /health
    (503) during the load, but "running" must not be read as "ready to serve"."""

    def __init__(self) -> None:
        super().__init__()
        self.ready = False
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.ready and record.getMessage().startswith("Uvicorn running on"):
            self.held.append(record)
            return False
        return True

    def release(self, to: logging.Logger) -> None:
        self.ready = True
        for record in self.held:
            to.handle(record)
        self.held.clear()


async def _stop_when_the_engine_dies(async_engine, server, poll_s: float = 0.1) -> None:
    """Stop the HTTP server once the engine is dead, so the process exits non-zero and a supervisor (systemd,
    Kubernetes) restarts it: a dead engine never comes back, and a server answering 503 forever is never
    restarted. In-flight streams have already been given their error event when dead_cause is set; uvicorn's
    shutdown lets them finish sending it."""
    while async_engine.dead_cause is None or server.draining:
        await asyncio.sleep(poll_s)
    logger.error("the engine is dead (%s); stopping the server so that it can be restarted",
                 async_engine.dead_cause)
    server.should_exit = True


_UVICORN_LOG_LEVELS = {"CRITICAL": "critical", "ERROR": "error", "WARNING": "warning", "WARN": "warning",
                       "INFO": "info", "DEBUG": "debug"}


def run(ns: argparse.Namespace, engine_factory=build_engine) -> int:
    """Load the model in the engine core process (or on the engine thread, --engine-thread) while uvicorn
    already answers /health (503), then serve. engine_factory(EngineArgs) builds the engine; for the core
    process it must be a module-level function (spawn pickles it by name)."""
    import uvicorn

    from ostinato.server.http import uvicorn_config

    args = engine_args_from(ns)  # a ConfigError reaches the CLI, which prints it (exit code 2)
    limits = limits_from(ns)
    name = args.served_model_name or default_served_model_name(args.model)  # the name LLMEngine gives it
    if getattr(ns, "engine_thread", False):
        async_engine = AsyncEngine(lambda: engine_factory(args))
    else:
        stall, kill = ns.engine_stall_timeout, ns.engine_kill_timeout
        if stall is not None and kill is not None and kill < stall:
            raise ConfigError(f"--engine-kill-timeout ({kill:g}) must be at least --engine-stall-timeout ({stall:g})")
        async_engine = ProcessAsyncEngine(args, factory=engine_factory, stall_timeout=stall, kill_timeout=kill)
    http_app = app.build_app(async_engine, api_key=api_keys_from(ns), served_model_name=name, limits=limits,
                             isolate_keys=not ns.shared_prefix_cache, report_cached_tokens=ns.report_cached_tokens)
    log_level = _UVICORN_LOG_LEVELS.get(str(getattr(ns, "log_level", "INFO")).upper(), "info")
    server = DrainingServer(uvicorn_config(http_app, limits, host=ns.host, port=ns.port, log_level=log_level),
                            http_app.state.serving, ns.shutdown_timeout)
    uvicorn_logger = logging.getLogger("uvicorn.error")  # the logger uvicorn announces the port on
    hold = HoldUntilReady()
    uvicorn_logger.addFilter(hold)

    async def main() -> int:
        logger.info("loading %s; until it is ready /health answers 503 (event loop: %s)", args.model,
                    type(asyncio.get_running_loop()).__module__.split(".")[0])
        async_engine.start()
        serving = asyncio.create_task(server.serve())
        drain = asyncio.create_task(server.drain(async_engine))
        ready = asyncio.create_task(async_engine.wait_ready())
        await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            cause = ready.exception().__cause__ or ready.exception()
            logger.error("ostinato could not start: %s", cause)
            server.should_exit = True
            await serving
            return 1
        if not ready.done():  # stopped (SIGINT, SIGTERM) while loading
            await serving
            drain.cancel()
            return 0
        hold.release(uvicorn_logger)
        # A small model can be ready before uvicorn has bound its socket (server.servers is set only then).
        while not server.started and not serving.done():
            await asyncio.sleep(0.01)
        sockets = getattr(server, "servers", None) or []
        port = sockets[0].sockets[0].getsockname()[1] if sockets else ns.port
        logger.info("serving %s on http://%s:%d; CUDA graphs: %s", name, ns.host, port,
                    async_engine.engine.graph_status)
        freeze_startup_heap()  # the front's start-up heap (and an engine thread's engine): startup_heap.py
        engine_died = asyncio.create_task(_stop_when_the_engine_dies(async_engine, server))
        await serving
        engine_died.cancel()
        drain.cancel()
        if server.draining:  # an orderly stop, even where the drain ran out of time (logged); not a dead engine
            return 1 if server.engine_died is not None else 0
        return 1 if engine_died.done() and not engine_died.cancelled() else 0

    loop_factory = event_loop_factory(ns.loop)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            return runner.run(main())
    finally:
        uvicorn_logger.removeFilter(hold)
        async_engine.shutdown()
