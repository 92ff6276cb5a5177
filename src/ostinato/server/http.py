"""uvicorn's httptools protocol with the two guards uvicorn lacks, and the uvicorn config that uses it.

- A request head (request line and headers) must arrive within `header_timeout` seconds of the connection
  opening or of its first byte. uvicorn times out idle keep-alive connections only after a response, so a
  client that connects and trickles header bytes (slowloris) would hold its connection for ever.
- A head over `max_head_bytes` is answered 431, and a request httptools cannot parse 400, both with OpenAI's
  error body (uvicorn sends plain text). httptools itself buffers a header without bound until it is complete,
  so the head's bytes are counted here as they arrive.

httptools (llhttp, in C) rather than h11: with h11, whose state machine is Python, the front's event loop spent about a
third more CPU per streamed token (docs/PERFORMANCE.md, "The server against offline").
"""

from __future__ import annotations

import asyncio
import json

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ostinato.server.limits import ServerLimits

HEAD_END = b"\r\n\r\n"


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response with OpenAI's error body, for when no ASGI response can be sent."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """See the module docstring. The class attributes are set on the subclass that `uvicorn_config` makes.

    A head is awaited from the connection's start and from each request's end until the next request's headers
    are complete. Its bytes are counted from the first read that finds it awaited; a read that ends one request
    and starts the next counts from the next read, so a head can pass the bound by at most one read."""

    header_timeout: float = 10.0
    max_head_bytes: int = 16 * 1024

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._awaiting_head = True
        self._head_bytes, self._head_tail = 0, b""
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head and self._head_over_limit(data):
            self._unset_keepalive_if_required()
            self._refuse(431, "Request Header Fields Too Large", self._head_message())
            return
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head = True
        self._head_bytes, self._head_tail = 0, b""

    def _head_over_limit(self, data: bytes) -> bool:
        """Whether the head, with this read, is over max_head_bytes (complete or not)."""
        scan = self._head_tail + data
        end = scan.find(HEAD_END)
        if end != -1:
            return self._head_bytes + end + len(HEAD_END) - len(self._head_tail) > self.max_head_bytes
        self._head_bytes += len(data)
        self._head_tail = scan[-(len(HEAD_END) - 1):]
        return self._head_bytes > self.max_head_bytes

    def _head_message(self) -> str:
        return (f"the request line and headers exceed the server's limit of {self.max_head_bytes} bytes; send "
                "smaller headers (or restart the server with a larger --max-header-bytes)")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self.logger.warning("%s (%d)", message, status)
        self.transport.write(_raw_error(status, reason, message))
        self.transport.close()

    def _waiting_for_head(self) -> bool:
        """A head is awaited, no response of ours is being written and the connection is open."""
        no_response = self.cycle is None or self.cycle.response_complete
        return self._awaiting_head and no_response and not self.transport.is_closing()

    def _watch_head(self) -> None:
        """Arm the timer while a head is awaited and no response is being written (once per head, so trickled
        bytes do not extend it); disarm it once the head has arrived."""
        waiting = self._waiting_for_head()
        if waiting and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)
        elif not waiting:
            self._cancel_head_timer()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._waiting_for_head():
            return
        self.transport.write(_raw_error(408, "Request Timeout", "the request line and headers did not arrive "
                                        f"within {self.header_timeout:g} s; send them at once"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "Bad Request", "invalid HTTP request: the request line or headers could not be parsed")


def uvicorn_config(app, limits: ServerLimits, *, host: str, port: int, log_level: str = "info",
                   **kwargs) -> uvicorn.Config:
    """A uvicorn.Config serving `app` with the guarded protocol and the limits' timeouts and header cap."""
    protocol = type("Guarded", (GuardedHttpToolsProtocol,), {"header_timeout": limits.header_timeout,
                                                             "max_head_bytes": limits.max_header_bytes})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          timeout_keep_alive=limits.timeout_keep_alive, **kwargs)
