"""The engine core in its own process, behind the AsyncEngine interface (vLLM v1's EngineCore, in small).

Why: with the engine on a thread of the server, the engine loop, the event loop and the HTTP/JSON work share
one GIL. Every step the engine thread waits for the GIL the loop holds (up to the 5 ms switch interval), and
the loop's per-chunk work adds to the step instead of overlapping it. Here the engine core (scheduler, model,
detokenizer, stop strings) runs in a process of its own, started with `spawn` (CUDA must not be forked), and
the server's process only parses HTTP, routes outputs and writes JSON.

The core's loop lives in engine/core_loop.py. Protocol (pickled tuples over two one-way pipes):
- front -> core: ("add", request_id, prompt, params) | ("abort", request_id) | ("stats", call_id) | ("stop",)
- core -> front: ("ready", EngineInfo) | ("added", request_id, prompt_token_ids, error) |
  ("step", outputs, now) | ("stats", call_id, EngineStats) | ("dead", cause) | ("batch", [message, ...])
  (messages that queued while the front was busy, in order: the core's loop never waits on the front)

Per step the core sends one message (alone, or in a batch): the step's DELTA outputs (what the server asks for)
without the prompt (sent once, with "added"). A reader thread in the front receives, rebuilds the outputs, runs
the step observer (metrics) and hands each event loop its outputs with one `call_soon_threadsafe` per step.

Failure: if a step raises, the core reports ("dead", cause) and exits; if the process dies outright the pipe
closes. Either way the front marks itself dead: pending requests get EngineDeadError and /health says 503.
A core that stalls is found by a watchdog (core_link.py), reported, then killed and treated as dead.
An abort ends the stream at once in the front; the core frees the KV blocks when it reads the abort, before
its next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable

from ostinato.config import EngineArgs
from ostinato.errors import EngineDeadError, EngineNotReadyError, InvalidRequestError
from ostinato.sampling_params import SamplingParams
from ostinato.engine.core_link import BATCH, CommandSender, CoreWatchdog
from ostinato.engine.core_logging import parent_logging
from ostinato.engine.core_loop import EngineInfo, build_engine, core_main
from ostinato.engine.request_stream import ENDED, RequestStream, StepObserver, call_soon, deliver, fail, settle
from ostinato.engine.outputs import EngineStats, RequestOutput, output_from_record

if TYPE_CHECKING:
    from ostinato.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    """A request the front has sent: its stream, and the prompt once the core accepted it."""

    stream: RequestStream
    accepted: asyncio.Future
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    arrival_time: float = 0.0


class ProcessAsyncEngine:
    """AsyncEngine's interface (start, wait_ready, add_request, generate, abort, get_stats, shutdown, is_ready,
    dead_cause, engine, observer) over an engine core in its own process.

    `factory(args)` builds the engine in the core process; it must be picklable by name (a module-level
    function), as `spawn` requires. `stall_timeout` / `kill_timeout`: the watchdog's bounds (None: off).
    """

    def __init__(self, args: EngineArgs, *, factory: Callable[[EngineArgs], "LLMEngine"] = build_engine,
                 observer: StepObserver | None = None, stall_timeout: float | None = None,
                 kill_timeout: float | None = None):
        self.args = args
        self.observer = observer
        self._factory = factory
        self._lock = threading.Lock()  # guards _requests and _calls; never held while blocking
        self._requests: dict[str, _Pending] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._info: EngineInfo | None = None
        self._ready = threading.Event()
        self._dead_cause: str | None = None
        self._stopping = False  # shutdown() was called: the core's exit is expected
        self._process = None
        self._reader: threading.Thread | None = None
        self._sender: CommandSender | None = None
        self._watchdog = CoreWatchdog(stall_timeout, kill_timeout, ping=self._ping, kill=self._kill_stalled,
                                      has_work=lambda: self._info is not None and bool(self._requests or self._calls))

    # ---- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._process is not None:
            raise RuntimeError("ProcessAsyncEngine.start() was already called")
        ctx = multiprocessing.get_context("spawn")
        commands_recv, commands = ctx.Pipe(duplex=False)
        self._events, events_send = ctx.Pipe(duplex=False)
        self._process = ctx.Process(target=core_main, name="ostinato-engine-core", daemon=True,
                                    args=(self._factory, self.args, commands_recv, events_send,
                                          parent_logging()))
        self._process.start()
        commands_recv.close()  # the core's ends: the front must see EOF when the core dies
        events_send.close()
        self._sender = CommandSender(commands)  # sends never block the event loop, even with the core stopped
        self._watchdog.start()
        self._reader = threading.Thread(target=self._read, name="ostinato-engine-reader", daemon=True)
        self._reader.start()

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the core process; requests still pending get EngineDeadError."""
        if self._process is None:
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except (EngineDeadError, OSError):
            pass
        self._process.join(timeout)
        if self._process.is_alive():  # SIGKILL: a stopped process would not act on SIGTERM
            self._process.kill()
            self._process.join(5)
        self._watchdog.stop()
        self._die("the engine was shut down")

    async def wait_ready(self) -> None:
        while not self._ready.is_set():
            await asyncio.sleep(0.05)
        if self._info is None:
            raise EngineDeadError(self._dead_cause or "the engine did not start")

    @property
    def is_ready(self) -> bool:
        return self._info is not None and self._dead_cause is None

    @property
    def dead_cause(self) -> str | None:
        return self._dead_cause

    @property
    def stall_cause(self) -> str | None:  # silent past the stall bound with work pending
        return None if self._dead_cause is not None else self._watchdog.stall_cause

    @property
    def engine(self) -> EngineInfo:
        if self._info is None:
            if self._dead_cause is not None:
                raise EngineDeadError(f"the engine is not serving: {self._dead_cause}")
            raise EngineNotReadyError("the engine is still loading")
        return self._info

    @property
    def core_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    # ---- requests ---------------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        loop = asyncio.get_running_loop()
        pending = _Pending(RequestStream(self, request_id, loop, params.output_kind), loop.create_future(),
                           arrival_time=time.monotonic())
        with self._lock:
            if self._dead_cause is not None:
                raise EngineDeadError(f"the engine is not serving: {self._dead_cause}")
            if request_id in self._requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._requests[request_id] = pending
        pending.prompt = prompt if isinstance(prompt, str) else None
        try:
            self._send(("add", request_id, prompt, params))
        except EngineDeadError:
            with self._lock:
                self._requests.pop(request_id, None)
            raise
        try:
            await pending.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return pending.stream

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, params)
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, returns at once): its stream ends now; the core frees its blocks."""
        with self._lock:
            pending = self._requests.pop(request_id, None)
        try:
            self._send(("abort", request_id))
        except EngineDeadError:
            pass  # a dead core holds no KV blocks worth freeing
        if pending is not None:
            if self.observer is not None:
                try:
                    self.observer.on_request_aborted(request_id)
                except Exception:
                    logger.exception("step observer failed")
            call_soon(pending.stream.loop, deliver, [(pending.stream, ENDED)])

    async def get_stats(self) -> EngineStats:
        _ = self.engine  # raises unless the engine is serving
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._dead_cause is not None:
                raise EngineDeadError(f"the engine is not serving: {self._dead_cause}")
            call_id = next(self._call_ids)
            self._calls[call_id] = fut
        self._send(("stats", call_id))
        return await asyncio.wrap_future(fut)

    def _send(self, message) -> None:
        """Queue a command; EngineDeadError if the core is known dead (else _die fails what it left pending)."""
        if self._dead_cause is not None or self._sender.broken:
            raise EngineDeadError(f"the engine is not serving: {self._dead_cause or 'the engine core is gone'}")
        self._sender.send(message)

    def _ping(self) -> None:  # the watchdog's question: a stats call whose answer only counts as progress
        with self._lock:
            call_id = next(self._call_ids)
            self._calls[call_id] = concurrent.futures.Future()
        self._send(("stats", call_id))

    def _kill_stalled(self, cause: str) -> None:
        self._die(cause)  # first, so the cause is the stall, not the exit code the reader then sees
        self._process.kill()

    # ---- the reader thread --------------------------------------------------------------------------------
    def _read(self) -> None:
        try:
            while True:
                message = self._events.recv()
                self._watchdog.progress()
                if not all(map(self._on_message, message[1] if message[0] == BATCH else (message,))):
                    return
        except (EOFError, OSError):
            if self._stopping:
                self._die("the engine was shut down")
            else:
                self._process.join(5)  # reap it, for the exit code
                self._die(f"the engine core process exited (exit code {self._process.exitcode})")
        finally:
            self._ready.set()

    def _on_message(self, message: tuple) -> bool:
        """Act on one message of the core; False once it said it is dead."""
        kind = message[0]
        if kind == "step":
            self._on_step(message[1], message[2])
        elif kind == "added":
            self._on_added(*message[1:])
        elif kind == "stats":
            fut = self._calls.pop(message[1], None)
            if fut is not None:
                fut.set_result(message[2])
        elif kind == "ready":
            self._on_ready(message[1])
        elif kind == "dead":
            self._die(message[1])
            return False
        return True

    def _on_ready(self, info: EngineInfo) -> None:
        self._info = info
        self._ready.set()

    def _on_added(self, request_id: str, prompt_token_ids, error) -> None:
        with self._lock:
            pending = self._requests.get(request_id)
            if pending is not None and error is not None:
                del self._requests[request_id]
        if pending is None:
            return
        pending.prompt_token_ids = prompt_token_ids
        if not call_soon(pending.stream.loop, settle, pending.accepted, error) and error is None:
            self.abort(request_id)  # its caller's loop is gone: free the blocks

    def _on_step(self, items: list, now: float) -> None:
        outputs, by_loop = [], defaultdict(list)
        with self._lock:
            for record in items:
                request_id = record[0]
                pending = self._requests.get(request_id)
                if pending is None:  # aborted in the front while the core was stepping
                    continue
                out = output_from_record(record, pending.prompt, pending.prompt_token_ids, pending.arrival_time)
                outputs.append(out)
                by_loop[pending.stream.loop].append((pending.stream, out))
                if out.finished:
                    del self._requests[request_id]
            # Under the lock, so an abort either comes before (its request is skipped above) or after.
            if self.observer is not None:
                try:
                    self.observer.on_step(outputs, now)
                except Exception:  # metrics must never take the engine down
                    logger.exception("step observer failed")
        for loop, batch in by_loop.items():
            if not call_soon(loop, deliver, batch):  # that loop is closed: nobody is listening
                for stream, _ in batch:
                    self.abort(stream.request_id)

    def _die(self, cause: str) -> None:
        with self._lock:
            if self._dead_cause is None:
                self._dead_cause = cause
            pending, self._requests = self._requests, {}
            calls, self._calls = self._calls, {}
        error = EngineDeadError(f"the engine is not serving: {self._dead_cause}")
        for fut in calls.values():
            fut.set_exception(error)
        by_loop = defaultdict(list)
        for p in pending.values():
            by_loop[p.stream.loop].append((p.stream, p.accepted))
        for loop, batch in by_loop.items():
            call_soon(loop, fail, batch, error)
        self._ready.set()

