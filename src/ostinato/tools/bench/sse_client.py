"""A lean HTTP/1.1 client for load tests that stream: an asyncio Protocol that parses the answer itself.

Why not httpx, nor h11: a load generator must cost less than the server it measures. With 64 streams, httpx spent
about 170 us of CPU per streamed chunk on the 2-core development machine (anyio streams, httpcore's connection
pool, which scans every connection at every request and response event, and its line decoders), more than the
whole server; h11 then cost about 15 us per chunk, a third of the load generator's time. An answer here is a
status line and headers, then a body framed by Content-Length, by chunked transfer coding, or by the connection's
end: the parser below reads those and hands every complete server-sent event to a callback, with the time the
bytes arrived. One request at a time per connection; the connection is kept alive between requests when the
server allows it. Neither 1xx answers nor pipelining are spoken (a load test's server sends neither).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from urllib.parse import urlsplit

# on_event(event, now): one server-sent event (its bytes, without the blank line that ends it) and the
# time.perf_counter() at which the bytes that completed it arrived.
EventCallback = Callable[[bytes, float], None]

_MAX_HEAD_BYTES = 64 * 1024


class HTTPStatusError(Exception):
    """The server answered with a status other than 200."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"HTTP {status}: {body.decode(errors='replace')[:200]}")
        self.status, self.body = status, body


class _BadHTTP(Exception):
    """The server's bytes are not an HTTP/1.1 answer this parser reads."""


class _Protocol(asyncio.Protocol):
    """One connection; `start` arms it for the next answer, which `data_received` parses as it arrives."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.lost = False
        self.reusable = False  # the last answer ended cleanly and the server keeps the connection open
        self._done: asyncio.Future | None = None
        self._on_event: EventCallback | None = None
        self._buf = b""  # bytes received and not parsed yet
        self._state = "idle"  # idle | head | chunk-size | chunk-data | length | until-close | trailers
        self._status = 0
        self._left = 0  # bytes of the current chunk (or of a Content-Length body) still to come
        self._keep_alive = False
        self._body: list[bytes] = []  # a non-200 answer's body, or a plain request's
        self._pending = b""  # the start of a server-sent event whose end has not arrived

    def start(self, done: asyncio.Future, on_event: EventCallback | None) -> None:
        self._done, self._on_event, self._body, self._pending = done, on_event, [], b""
        self._state, self.reusable = "head", False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._buf = self._buf + data if self._buf else data
        try:
            self._parse(now)
        except (_BadHTTP, ValueError) as e:
            self._fail(ConnectionError(f"bad HTTP from the server: {e}"))
            if self.transport is not None:
                self.transport.close()

    def eof_received(self):
        self.lost = True
        if self._state == "until-close":
            self._finish(time.perf_counter())
        else:
            self._fail(ConnectionError("the server closed the connection mid-response"))
        return False

    def connection_lost(self, exc) -> None:
        self.lost = True
        self._fail(ConnectionError(f"the connection was lost: {exc or 'closed by the server'}"))

    def _fail(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)

    # ---- parsing ---------------------------------------------------------------------------------------
    def _parse(self, now: float) -> None:
        while self._buf:
            state = self._state
            if state == "chunk-data" or state == "length":
                if not self._take_body(now):
                    return
            elif state == "chunk-size":
                if not self._read_chunk_size():
                    return
            elif state == "head":
                if not self._read_head():
                    return
            elif state == "until-close":
                self._deliver(self._buf, now)
                self._buf = b""
            elif state == "trailers":
                if not self._read_trailers(now):
                    return
            else:  # idle: nothing asked for
                raise _BadHTTP(f"{len(self._buf)} bytes arrived with no request in flight")

    def _read_head(self) -> bool:
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            if len(self._buf) > _MAX_HEAD_BYTES:
                raise _BadHTTP(f"no end of the answer's head within {_MAX_HEAD_BYTES} bytes")
            return False
        lines = self._buf[:end].decode("latin-1").split("\r\n")
        self._buf = self._buf[end + 4:]
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise _BadHTTP(f"status line {lines[0][:80]!r}")
        self._status = int(rest[:3])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        connection = headers.get("connection", "")
        self._keep_alive = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
        if "chunked" in headers.get("transfer-encoding", ""):
            self._state = "chunk-size"
        elif "content-length" in headers:
            self._left, self._state = int(headers["content-length"]), "length"
            if self._left == 0:
                self._finish(time.perf_counter())
        else:
            self._keep_alive, self._state = False, "until-close"
        return True

    def _read_chunk_size(self) -> bool:
        end = self._buf.find(b"\r\n")
        if end < 0:
            if len(self._buf) > 1024:
                raise _BadHTTP("a chunk-size line over 1 KiB")
            return False
        size = int(self._buf[:end].split(b";", 1)[0], 16)  # chunk extensions are ignored
        self._buf = self._buf[end + 2:]
        if size == 0:
            self._state = "trailers"
        else:
            self._left, self._state = size, "chunk-data"
        return True

    def _take_body(self, now: float) -> bool:
        """Body bytes of the current chunk (or Content-Length body), and a chunk's closing CRLF; False when
        nothing more can be taken until more bytes arrive."""
        if self._left:
            piece, self._buf = self._buf[:self._left], self._buf[self._left:]
            self._left -= len(piece)
            self._deliver(piece, now)
            if self._left:
                return False
        if self._state == "length":
            self._finish(now)
            return True
        if len(self._buf) < 2:
            return False
        if self._buf[:2] != b"\r\n":
            raise _BadHTTP("a chunk not followed by CRLF")
        self._buf, self._state = self._buf[2:], "chunk-size"
        return True

    def _read_trailers(self, now: float) -> bool:
        if self._buf.startswith(b"\r\n"):
            self._buf = self._buf[2:]
        else:
            end = self._buf.find(b"\r\n\r\n")
            if end < 0:
                return False
            self._buf = self._buf[end + 4:]
        self._finish(now)
        return True

    def _deliver(self, data: bytes, now: float) -> None:
        if self._status == 200 and self._on_event is not None:
            events = (self._pending + data).split(b"\n\n") if self._pending else data.split(b"\n\n")
            self._pending = events.pop()  # what follows the last blank line: an event not yet complete
            for event in events:
                if event:
                    self._on_event(event, now)
        else:
            self._body.append(data)

    def _finish(self, now: float) -> None:
        self._state = "idle"
        self.reusable = self._keep_alive and not self.lost
        if self._buf:
            raise _BadHTTP(f"{len(self._buf)} bytes after the end of the answer")
        if self._done is not None and not self._done.done():
            self._done.set_result((self._status, b"".join(self._body)))


class Connection:
    """One keep-alive HTTP/1.1 connection to `base_url` (http only), opened on first use and again after the
    server closes it."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None):
        url = urlsplit(base_url)
        if url.scheme != "http":
            raise ValueError(f"the load generator speaks plain http only, got {base_url!r}")
        self._host, self._port = url.hostname or "127.0.0.1", url.port or 80
        self._prefix = url.path.rstrip("/")
        head = [f"host: {url.netloc}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._head = "\r\n".join(head)
        self._protocol: _Protocol | None = None

    async def request(self, method: str, path: str, body: bytes = b"", on_event: EventCallback | None = None,
                      timeout: float | None = None) -> tuple[int, bytes]:
        """Send a request; returns (status, body). With `on_event`, a 200 answer's body is handed over as
        server-sent events as they arrive (and the returned body is empty)."""
        protocol = await self._ready()
        done = asyncio.get_running_loop().create_future()
        protocol.start(done, on_event)
        head = f"{method} {self._prefix + path} HTTP/1.1\r\n{self._head}\r\ncontent-length: {len(body)}\r\n"
        if body:
            head += "content-type: application/json\r\n"
        protocol.transport.write(head.encode("latin-1") + b"\r\n" + body)
        try:
            return await asyncio.wait_for(done, timeout)
        except BaseException:
            self.close()  # a response left half-read makes the connection useless
            raise
        finally:
            if not protocol.reusable:
                self.close()

    async def _ready(self) -> _Protocol:
        if self._protocol is None or self._protocol.lost:
            loop = asyncio.get_running_loop()
            _, self._protocol = await loop.create_connection(_Protocol, self._host, self._port)
        return self._protocol

    def close(self) -> None:
        if self._protocol is not None and self._protocol.transport is not None:
            self._protocol.transport.close()
        self._protocol = None
