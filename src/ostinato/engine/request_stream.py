"""RequestStream: the outputs of one request as an async iterator, filled from the engine's thread or process.

Shared by the two engines that serve asyncio callers (engine/async_engine.py: an engine thread;
engine/core_process.py: an engine process), which both deliver through `deliver` on the stream's event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from ostinato.engine.outputs import RequestOutput, merge_deltas
from ostinato.sampling_params import RequestOutputKind

# Put on a stream when its request was aborted: iteration stops without a finished output.
ENDED = object()


class RequestOwner(Protocol):
    """What created the stream: closing a stream early aborts its request there."""

    def abort(self, request_id: str) -> None: ...


class StepObserver(Protocol):
    """Sees every step's outputs on the engine thread (the server's latency histograms use it).

    Called on the engine thread, so it must be quick and thread-safe towards readers on other threads.
    """

    def on_step(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_request_aborted(self, request_id: str) -> None:
        """The request was aborted (it will get no finished output); drop any per-request state."""


class RequestStream:
    """The outputs of one request, in order, as an async iterator. Created by AsyncEngine.add_request.

    Iteration ends after the finished output (or when the request is aborted). `close()` aborts the request if
    it has not finished; use `async with stream:` or call it in a `finally` so a consumer that stops early
    frees the request's KV blocks.
    """

    def __init__(self, owner: RequestOwner, request_id: str, loop: asyncio.AbstractEventLoop,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.request_id = request_id
        self.loop = loop
        self.output_kind = output_kind
        self.finished = False
        self._owner = owner
        # Items: RequestOutput, an exception to raise, or ENDED (aborted: stop iterating). Event-loop only.
        self._items: deque = deque()
        # The reader's future while it waits for an item: a stream has one reader, and a bare future is
        # cheaper to wake than an asyncio.Event, which a streamed request pays for every step.
        self._waiter: asyncio.Future | None = None

    # Called on the event loop (scheduled from the engine thread).
    def _put(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():  # a reader cancelled while it waited left its future cancelled
                waiter.set_result(None)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = self.loop.create_future()
            await self._waiter
        item = self._items.popleft()
        if isinstance(item, RequestOutput) and self._items and isinstance(self._items[0], RequestOutput):
            # Several outputs queued up (an exception or the end stays queued for the next call).
            if self.output_kind is RequestOutputKind.DELTA:
                deltas = [item]
                while self._items and isinstance(self._items[0], RequestOutput):
                    deltas.append(self._items.popleft())
                item = merge_deltas(deltas)
            else:  # CUMULATIVE: the newest holds everything
                while self._items and isinstance(self._items[0], RequestOutput):
                    item = self._items.popleft()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item is ENDED:
            self.finished = True
            raise StopAsyncIteration
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it already finished. Safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


def deliver(items: list) -> None:
    """Put each (stream, item) on its stream; runs on the streams' event loop."""
    for stream, item in items:
        stream._put(item)


def settle(fut: asyncio.Future, error: BaseException | None) -> None:
    """Resolve `fut` (on its loop): None, or `error` raised; nothing if it is already done (cancelled)."""
    if not fut.done():
        fut.set_result(None) if error is None else fut.set_exception(error)


def fail(items: list, error: BaseException) -> None:
    """On the streams' loop, for each (stream, accepted) of a request the engine can no longer serve: where its
    add_request still waits for acceptance, that raises `error`; else its stream ends with it. Decided here, on the
    loop, not on the thread that saw the engine die: an acceptance that thread scheduled a moment before has then
    run, so the request is not left accepted with a stream that nothing ever ends."""
    for stream, accepted in items:
        if accepted.done():
            stream._put(error)
        else:
            accepted.set_exception(error)


def call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """loop.call_soon_threadsafe(fn, *args); False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True
