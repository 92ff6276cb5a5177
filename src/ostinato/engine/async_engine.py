"""AsyncEngine: drives one LLMEngine from a background thread for asyncio callers (the HTTP server).

LLMEngine is not thread-safe, so exactly one thread, the engine thread, ever touches it. Callers post
commands (add a request, abort one, read stats) to a queue; the engine thread applies them between steps,
then runs `engine.step()` while any request is unfinished, so every in-flight request shares each step
(continuous batching). When nothing is queued and nothing is running the thread sleeps on a condition
variable: an idle server burns no CPU.

Outputs travel back per request through a RequestStream, filled with `loop.call_soon_threadsafe` (one call
per step and event loop, not one per request, so a step of 256 requests costs one loop wake-up). They are what
the request's SamplingParams.output_kind asks for: a consumer that falls behind gets the DELTA outputs that
queued up merged into one (so a server sends one chunk for them), or the newest CUMULATIVE one.

A consumer that stops early (client disconnect, task cancelled, `break`) aborts its request, which frees its
KV blocks at once. If `engine.step()` raises, the engine is dead: every pending request gets an
EngineDeadError, new ones are refused, and `dead_cause` says why (the server's /health turns 503).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Union

from ostinato.errors import EngineDeadError, EngineNotReadyError  # noqa: F401 (re-exported for callers)
from ostinato.sampling_params import SamplingParams
from ostinato.engine.incident import report_step_failure
from ostinato.engine.outputs import EngineStats, RequestOutput
from ostinato.engine.request_stream import ENDED, RequestStream, StepObserver, deliver  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    from ostinato.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class _Command:
    """Work for the engine thread: `run(engine)`, or `fail(exc)` if the engine is dead before it runs."""

    run: Callable[["LLMEngine"], None]
    fail: Callable[[BaseException], None]


EngineOrFactory = Union["LLMEngine", Callable[[], "LLMEngine"]]


class AsyncEngine:
    """Runs an LLMEngine on its own thread and serves requests to asyncio code.

    `engine` is an LLMEngine, or a zero-argument factory that builds one: the factory runs on the engine
    thread after `start()`, so the server can answer /health (503, starting) while the model loads, and all
    device work (loading, graph capture, steps) happens on one thread.
    """

    def __init__(self, engine: EngineOrFactory, *, observer: StepObserver | None = None):
        is_engine = hasattr(engine, "step")  # duck-typed: tests may drive a wrapped or stand-in engine
        self._engine: LLMEngine | None = engine if is_engine else None
        self._factory: Callable[[], LLMEngine] | None = None if is_engine else engine
        self.observer = observer
        self._cond = threading.Condition()
        self._commands: list[_Command] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond
        self._dead_cause: str | None = None  # set once, under _cond
        self._ready = threading.Event()  # set when the engine is loaded, or when loading failed
        self._load_error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine.start() was already called")
        self._thread = threading.Thread(target=self._run, name="ostinato-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread; requests still pending get EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    async def wait_ready(self) -> None:
        """Wait until the engine is loaded; raises EngineDeadError (with the cause chained) if loading failed."""
        # Polled, not waited on in an executor thread: a Ctrl-C during a long load must not hang on that thread.
        while not self._ready.is_set():
            await asyncio.sleep(0.05)
        if self._engine is None:
            raise EngineDeadError(self._dead_cause or "the engine did not start") from self._load_error

    @property
    def is_ready(self) -> bool:
        """True while the engine is loaded and serving."""
        return self._engine is not None and self._ready.is_set() and self._dead_cause is None

    @property
    def dead_cause(self) -> str | None:
        """Why the engine stopped (start-up failure, a step that raised, shutdown), or None while alive."""
        return self._dead_cause

    @property
    def stall_cause(self) -> str | None:
        """Always None: the stall watchdog watches the engine core process (core_link.py), not this thread."""
        return None

    @property
    def engine(self) -> "LLMEngine":
        """The wrapped engine, for read-only facts (tokenizer, configs, graph_status). Do not call step() on it."""
        if self._engine is None:
            if self._dead_cause is not None:
                raise EngineDeadError(f"the engine is not serving: {self._dead_cause}")
            raise EngineNotReadyError("the engine is still loading")
        return self._engine

    # ---- requests ---------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Queue a request; returns its output stream once the engine accepted it.

        Raises what LLMEngine.add_request raises (InvalidRequestError, QueueFullError) before any output, and
        EngineDeadError if the engine is not serving.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop, params.output_kind)
        accepted: asyncio.Future = loop.create_future()

        def settle(exc: BaseException | None) -> None:
            if not accepted.done():
                accepted.set_result(None) if exc is None else accepted.set_exception(exc)

        def run(engine: "LLMEngine") -> None:
            try:
                engine.add_request(request_id, prompt, params)
            except Exception as e:
                loop.call_soon_threadsafe(settle, e)
                return
            self._streams[request_id] = stream
            loop.call_soon_threadsafe(settle, None)

        self._submit(_Command(run, lambda exc: loop.call_soon_threadsafe(settle, exc)))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been accepted just as we were cancelled
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs (of its params.output_kind) until it finishes; aborts it if the consumer
        stops early."""
        stream = await self.add_request(request_id, prompt, params)
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once). Its stream ends; unknown ids are ignored."""

        def run(engine: "LLMEngine") -> None:
            engine.abort(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                self._notify_aborted(request_id)
                self._deliver_soon(stream.loop, [(stream, ENDED)])

        try:
            self._submit(_Command(run, lambda exc: None))
        except EngineDeadError:
            pass  # a dead engine holds no KV blocks worth freeing

    async def get_stats(self) -> EngineStats:
        """engine.stats(), read on the engine thread between steps (so never mid-update).

        Raises EngineNotReadyError while the engine loads, EngineDeadError if it never loaded.
        """
        _ = self.engine  # raises unless an engine exists
        return await asyncio.wrap_future(self._call(lambda engine: engine.stats()))

    def _call(self, fn: Callable[["LLMEngine"], object]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def run(engine: "LLMEngine") -> None:
            try:
                fut.set_result(fn(engine))
            except Exception as e:
                fut.set_exception(e)

        try:
            self._submit(_Command(run, fut.set_exception))
        except EngineDeadError:
            # The engine thread has exited, so reading the engine here races with nothing.
            run(self.engine)
        return fut

    # ---- engine thread ------------------------------------------------------------------------------
    def _submit(self, command: _Command) -> None:
        with self._cond:
            if self._dead_cause is not None:
                raise EngineDeadError(f"the engine is not serving: {self._dead_cause}")
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        if self._factory is not None:
            try:
                self._engine = self._factory()
            except BaseException as e:  # report any start-up failure to whoever waits, then stop
                self._load_error = e
                self._die(f"engine start-up failed: {type(e).__name__}: {e}", e)
                self._ready.set()
                return
        self._ready.set()
        engine = self._engine
        has_work = False
        while True:
            with self._cond:
                while not (self._commands or self._stopping or has_work):
                    self._cond.wait()
                if self._stopping:
                    break
                commands, self._commands = self._commands, []
            for command in commands:
                try:
                    command.run(engine)
                except Exception:  # e.g. the caller's event loop closed: its problem, not the engine's
                    logger.exception("an engine command failed")
            has_work = engine.has_unfinished()
            if not has_work:
                continue
            try:
                outputs = engine.step()
            except BaseException as e:
                self._die(report_step_failure(logger, "engine step failed"), e)
                return
            self._dispatch(outputs)
        self._die("the engine was shut down", None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if self.observer is not None:
            try:
                self.observer.on_step(outputs, time.monotonic())
            except Exception:  # metrics must never take the engine down
                logger.exception("step observer failed")
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_loop[stream.loop].append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, items in by_loop.items():
            self._deliver_soon(loop, items)

    def _deliver_soon(self, loop: asyncio.AbstractEventLoop, items: list) -> None:
        try:
            loop.call_soon_threadsafe(deliver, items)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening, free the blocks
            for stream, _ in items:
                if self._streams.pop(stream.request_id, None) is not None and self._engine is not None:
                    self._engine.abort(stream.request_id)
                    self._notify_aborted(stream.request_id)

    def _notify_aborted(self, request_id: str) -> None:
        """Tell the observer that an aborted request is gone."""
        if self.observer is not None:
            try:
                self.observer.on_request_aborted(request_id)
            except Exception:
                logger.exception("step observer failed")

    def _die(self, cause: str, exc: BaseException | None) -> None:
        """Mark the engine dead and fail everything pending: queued commands and in-flight requests."""
        with self._cond:
            if self._dead_cause is None:
                self._dead_cause = cause
            commands, self._commands = self._commands, []
        error = EngineDeadError(f"the engine is not serving: {cause}")
        error.__cause__ = exc
        for command in commands:
            command.fail(error)
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream in self._streams.values():
            by_loop[stream.loop].append((stream, error))
        self._streams.clear()
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(deliver, items)
            except RuntimeError:
                pass
