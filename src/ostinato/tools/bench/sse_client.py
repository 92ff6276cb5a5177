"""A lean HTTP/1.1 client for load tests that stream: h11 parses, an asyncio Protocol moves the bytes.

Why not httpx: a load generator must cost less than the server it measures. With 64 streams, httpx spent about
170 us of CPU per streamed chunk on the 2-core development machine (anyio streams, httpcore's connection pool,
which scans every connection at every request and response event, and its line decoders), more than the whole
server; h11 itself (which httpx and uvicorn both use) parses a chunk in about 15 us. Here each connection is
an asyncio Protocol whose data_received feeds h11 and hands every complete server-sent event to a callback,
with the time the bytes arrived. One request at a time per connection; the connection is kept alive between
requests when the server allows it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import h11

# on_event(event, now): one server-sent event (its bytes, without the blank line that ends it) and the
# time.perf_counter() at which the bytes that completed it arrived.
EventCallback = Callable[[bytes, float], None]


class HTTPStatusError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body.decode(errors='replace')[:200]}")
        self.status, self.body = status, body


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.conn = h11.Connection(h11.CLIENT)
        self.lost = False
        self._done: asyncio.Future | None = None
        self._on_event: EventCallback | None = None
        self._status = 0
        self._body: list[bytes] = []  # a non-200 answer's body, or a plain request's
        self._pending = b""  # the start of a server-sent event whose end has not arrived

    def start(self, done: asyncio.Future, on_event: EventCallback | None) -> None:
        self._done, self._on_event, self._status, self._body, self._pending = done, on_event, 0, [], b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        try:
            self.conn.receive_data(data)
            self._drain(now)
        except h11.ProtocolError as e:
            self._fail(ConnectionError(f"bad HTTP from the server: {e}"))

    def eof_received(self):
        self.lost = True
        try:
            self.conn.receive_data(b"")
            self._drain(time.perf_counter())
        except h11.ProtocolError as e:
            self._fail(ConnectionError(f"the server closed the connection mid-response: {e}"))
        return False

    def connection_lost(self, exc) -> None:
        self.lost = True
        self._fail(ConnectionError(f"the connection was lost: {exc or 'closed by the server'}"))

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    def _drain(self, now: float) -> None:
        while True:
            event = self.conn.next_event()
            kind = type(event)
            if kind is h11.Data:
                if self._status == 200 and self._on_event is not None:
                    self._events(bytes(event.data), now)
                else:
                    self._body.append(bytes(event.data))
            elif kind is h11.Response:
                self._status = event.status_code
            elif kind is h11.EndOfMessage:
                if self._done is not None and not self._done.done():
                    self._done.set_result((self._status, b"".join(self._body)))
                return
            elif event is h11.NEED_DATA or kind is h11.ConnectionClosed or event is h11.PAUSED:
                return

    def _events(self, data: bytes, now: float) -> None:
        events = (self._pending + data).split(b"\n\n")
        self._pending = events.pop()  # what follows the last blank line: an event not yet complete
        for event in events:
            if event:
                self._on_event(event, now)


class Connection:
    """One keep-alive HTTP/1.1 connection to `base_url` (http only), opened on first use and again after the
    server closes it."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None):
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"the load generator speaks plain http only, got {base_url!r}")
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._prefix = url.path.rstrip("/")
        self._headers = [("host", url.netloc), *(headers or {}).items()]
        self._protocol: _Protocol | None = None

    async def request(self, method: str, path: str, body: bytes = b"", on_event: EventCallback | None = None,
                      timeout: float | None = None) -> tuple[int, bytes]:
        """Send a request; returns (status, body). With `on_event`, a 200 answer's body is handed over as
        server-sent events as they arrive (and the returned body is empty)."""
        protocol = await self._ready()
        done = asyncio.get_running_loop().create_future()
        protocol.start(done, on_event)
        headers = [*self._headers, ("content-length", str(len(body)))]
        if body:
            headers.append(("content-type", "application/json"))
        conn = protocol.conn
        protocol.transport.write(conn.send(h11.Request(method=method, target=self._prefix + path, headers=headers))
                                 + (conn.send(h11.Data(data=body)) if body else b"")
                                 + conn.send(h11.EndOfMessage()))
        try:
            return await asyncio.wait_for(done, timeout)
        except BaseException:
            self.close()  # a response left half-read makes the connection useless
            raise
        finally:
            self._next_cycle()

    async def _ready(self) -> _Protocol:
        if self._protocol is None or self._protocol.lost:
            loop = asyncio.get_running_loop()
            _, self._protocol = await loop.create_connection(_Protocol, self._host, self._port)
        return self._protocol

    def _next_cycle(self) -> None:
        protocol = self._protocol
        if protocol is None:
            return
        conn = protocol.conn
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE and not protocol.lost:
            conn.start_next_cycle()
        else:
            self.close()

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None
