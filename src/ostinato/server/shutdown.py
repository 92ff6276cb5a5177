"""Stopping `ostinato serve` in order: SIGTERM (or Ctrl-C) drains, bounded by --shutdown-timeout, and exits 0.

uvicorn on its own stops accepting connections at the signal, waits without bound for the open ones, and
then raises the signal again, so even a clean drain ends with exit code 143 (SIGTERM), which a supervisor
records as a crash. Here, from the first signal on:
1. /health answers 503 "draining" (with Connection: close), and new completions 503, on every connection,
   kept-alive ones included. The port stays open meanwhile, so a load balancer reads "draining", not
   "connection refused", and stops routing here.
2. Requests in flight run to their end, for at most `shutdown_timeout` seconds. Then the engine is stopped:
   every stream still open gets an error event and ends, every plain request still waiting gets a 503.
3. uvicorn closes the connections (at most UVICORN_GRACE_S more), and `serve` returns 0.
A second signal stops at once, without waiting for anything.

An engine that dies during the drain on its own (its core killed or crashed, not stopped by step 2) fails the
requests in flight, which ends the drain early; `serve` then returns 1, as it does for a dead engine outside a
drain, so that a supervisor records the failure instead of a clean stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
import time

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

logger = logging.getLogger("ostinato.server.app")

UVICORN_GRACE_S = 5.0  # after the drain: for the last error events to be written and connections closed
POLL_S = 0.05
ENGINE_STOP_S = 2.0  # for the engine to stop after its current step, before it is killed


class DrainingServer(uvicorn.Server):
    """uvicorn.Server with the shutdown of the module docstring. `serving` is the app's state object that
    holds the `draining` flag (app.state.serving); run `drain(async_engine)` as a task beside `serve()`."""

    def __init__(self, config: uvicorn.Config, serving, shutdown_timeout: float):
        if not shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {shutdown_timeout}")
        config.timeout_graceful_shutdown = UVICORN_GRACE_S
        super().__init__(config)
        self.serving, self.shutdown_timeout = serving, shutdown_timeout
        self.drain_started: float | None = None  # time.monotonic() of the first signal
        self.cut = 0  # requests still in flight when the drain ran out of time
        self.engine_died: str | None = None  # the engine's dead_cause, where it died on its own during the drain

    @property
    def draining(self) -> bool:
        return self.drain_started is not None

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, without raising the signal again after the shutdown: a drained server exits 0."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.draining:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            return
        self.begin_drain()

    def begin_drain(self) -> None:
        """From now on /health says draining; drain() does the rest. Safe in a signal handler: sets flags only."""
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.serving.draining = True

    async def drain(self, async_engine) -> None:
        """Wait for the signal, then for the requests in flight (at most shutdown_timeout seconds); stop the
        engine if some are left (their streams get an error event), then let uvicorn shut down."""
        while not self.draining:
            await asyncio.sleep(POLL_S)
        logger.info("shutting down: /health now answers 503 draining; waiting up to %g s for %d request(s) in "
                    "flight", self.shutdown_timeout, len(self.server_state.tasks))
        deadline = self.drain_started + self.shutdown_timeout
        while self.server_state.tasks and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(POLL_S)
        # Read before the engine is stopped below: from then on a dead_cause is our own stop, not a failure.
        died = async_engine.dead_cause
        if died is not None:
            self.engine_died = died
            logger.error("the engine died during the drain (%s); exiting with code 1, not 0, as it did not stop "
                         "in order", died)
        if self.server_state.tasks:
            self.cut = len(self.server_state.tasks)
            logger.warning("--shutdown-timeout %g s passed with %d request(s) in flight; ending them with an "
                           "error", self.shutdown_timeout, self.cut)
            # Stopping the engine fails every pending request: streams send their error event and end.
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown, ENGINE_STOP_S)
        self.should_exit = True
