"""The link between the front and the engine core process, apart from routing its messages (core_process.py):
a sender that never blocks its caller (used both ways), and a watchdog for a core that stops making progress.

Why a sender thread: a pipe buffers about 64 KiB. With the core stopped (SIGSTOP, a hung driver call, a
debugger) the commands the event loop sends (adds, aborts, stats) fill it, and the next send would block the
event loop and with it /health. Commands go to a queue instead, and one thread writes them in order.
The core sends its steps' outputs the same way: a front that falls behind (one event loop writing a chunk per
stream per step) must not stall the engine's steps on a full pipe. Messages that queued up meanwhile go as one
BATCH message (one pickle, one write), which the reader unpacks in order; the front then merges each stream's
outputs into one chunk, so falling behind costs it less per token, not more.

Why a watchdog: a core that dies closes its pipe and the front notices at once; a core that stalls closes
nothing. The watchdog counts any message from the core as progress (a step's outputs, an answer). While work
is pending (a request, or a question to the core) and the core is silent, it asks the core for its stats once
a second, so a step that produces no output (a prefill chunk) still shows progress, since the core answers
between steps. Silent for `stall_timeout` seconds with work pending, the core is reported stalled; for
`kill_timeout` seconds, `kill` is called (the front then kills the core and treats it as dead).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

_CLOSE = object()
BATCH = "batch"  # ("batch", [message, ...]): messages that queued while the pipe was busy, in order


class CommandSender:
    """Writes messages to a pipe connection from its own thread, in the order `send` was called; `send` never
    blocks. A write that fails (the other end is closed: it died) stops the thread; the reader on the other side
    sees the pipe close and says why. batch: messages that queued up while a write was in progress are sent as
    one (BATCH, [...]) message."""

    def __init__(self, conn, name: str = "ostinato-core-sender", batch: bool = False):
        self._conn = conn
        self._batch = batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.broken = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, message) -> None:
        self._queue.put(message)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the messages already sent are written (or after `timeout` seconds)."""
        self._queue.put(_CLOSE)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            messages = [self._queue.get()]
            while self._batch and not self._queue.empty():
                messages.append(self._queue.get())
            closing = any(m is _CLOSE for m in messages)
            if closing:
                messages = messages[:next(i for i, m in enumerate(messages) if m is _CLOSE)]
            try:
                if len(messages) == 1:
                    self._conn.send(messages[0])
                elif messages:
                    self._conn.send((BATCH, messages))
            except (OSError, ValueError):  # closed: the other side is gone
                self.broken = True
                return
            except Exception:  # a message that cannot be pickled: close, so the other side sees the link end
                logger.exception("%s: a message could not be sent; closing the link", self._thread.name)
                self.broken = True
                self._conn.close()
                return
            if closing:
                return


class CoreWatchdog:
    """See the module docstring. `has_work()` says whether the core owes the front something; `ping()` asks the
    core a question (its answer is progress); `kill(cause)` is called once, from the watchdog's thread, when
    the core has been silent with work pending for kill_timeout seconds. None disables a bound."""

    def __init__(self, stall_timeout: float | None, kill_timeout: float | None, *, has_work: Callable[[], bool],
                 ping: Callable[[], None], kill: Callable[[str], None], ping_after: float = 1.0,
                 interval: float = 0.1):
        if stall_timeout is not None and kill_timeout is not None and kill_timeout < stall_timeout:
            raise ValueError(f"the kill bound ({kill_timeout:g} s) must be at least the stall bound "
                             f"({stall_timeout:g} s)")
        self.stall_timeout, self.kill_timeout = stall_timeout, kill_timeout
        self._has_work, self._ping, self._kill = has_work, ping, kill
        self._ping_after, self._interval = ping_after, interval
        self._last_progress = self._last_ping = time.monotonic()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.stall_timeout is None and self.kill_timeout is None:
            return
        self._thread = threading.Thread(target=self._run, name="ostinato-core-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def progress(self) -> None:
        """The core did something (called for every message it sends)."""
        self._last_progress = time.monotonic()

    def silent_for(self) -> float:
        """Seconds since the core last made progress while work was pending; 0 when none is pending."""
        return time.monotonic() - self._last_progress if self._has_work() else 0.0

    @property
    def stall_cause(self) -> str | None:
        """Why the core counts as stalled, or None while it makes progress (or owes nothing)."""
        silent = self.silent_for()
        if self.stall_timeout is None or silent < self.stall_timeout:
            return None
        return (f"the engine core has made no progress for {silent:.0f} s while work is pending "
                f"(--engine-stall-timeout {self.stall_timeout:g})")

    def _run(self) -> None:
        while not self._stopped.wait(self._interval):
            now = time.monotonic()
            if not self._has_work():  # an idle core owes nothing: silence is not a stall
                self._last_progress = now
                continue
            silent = now - self._last_progress
            if self.kill_timeout is not None and silent >= self.kill_timeout:
                cause = (f"the engine core made no progress for {silent:.0f} s while work was pending "
                         f"(--engine-kill-timeout {self.kill_timeout:g}); it was killed")
                logger.error("%s", cause)
                self._kill(cause)
                return
            if silent >= self._ping_after and now - self._last_ping >= self._ping_after:
                self._last_ping = now
                try:
                    self._ping()
                except Exception:  # a core that is gone: the reader reports it
                    logger.debug("watchdog ping failed", exc_info=True)
