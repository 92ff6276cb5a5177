"""uvicorn's h11 protocol with the two guards uvicorn lacks, and the uvicorn config that uses it.

- A request head (request line and headers) must arrive within `header_timeout` seconds of the connection
  opening or of its first byte. uvicorn times out idle keep-alive connections only after a response, so a
  client that connects and trickles header bytes (slowloris) would hold its connection for ever.
- A request h11 cannot parse, or whose head exceeds `h11_max_incomplete_event_size` bytes, is answered with
  OpenAI's error body (uvicorn sends plain text), 431 for an oversized head and 400 otherwise.

The h11 implementation is used always (not httptools): the guards hook into it.
"""

from __future__ import annotations

import asyncio
import json

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ostinato.server.limits import ServerLimits


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """A complete HTTP/1.1 error response with OpenAI's error body, for when h11 cannot write one."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": status}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class GuardedH11Protocol(H11Protocol):
    """See the module docstring. The class attributes are set on the subclass that `uvicorn_config` makes."""

    header_timeout: float = 10.0
    max_head_bytes: int = 16 * 1024  # also given to h11 (h11_max_incomplete_event_size)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._head_too_large(data):
            self._unset_keepalive_if_required()
            self._refuse(431, "Request Header Fields Too Large", self._head_message())
            return
        super().data_received(data)
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_timer()
        super().connection_lost(exc)

    def _head_too_large(self, data: bytes) -> bool:
        """h11 bounds only a head that arrives in pieces; one that arrives whole is checked here."""
        buffered = self.conn.trailing_data[0]
        if len(buffered) + len(data) <= self.max_head_bytes:
            return False
        end = (buffered + data).find(b"\r\n\r\n", 0, self.max_head_bytes + 4)
        return end == -1 or end + 4 > self.max_head_bytes

    def _head_message(self) -> str:
        return (f"the request line and headers exceed the server's limit of {self.max_head_bytes} bytes; send "
                "smaller headers (or restart the server with a larger --max-header-bytes)")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        self.logger.warning("%s (%d)", message, status)
        self.transport.write(_raw_error(status, reason, message))
        self.transport.close()

    def _watch_head(self) -> None:
        """Arm the timer while a request head is awaited (once per head, so trickled bytes do not extend it);
        disarm it once the head has arrived."""
        waiting = self.conn.their_state is h11.IDLE and not self.transport.is_closing()
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
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # no response of ours is half-written
            self.transport.write(_raw_error(408, "Request Timeout", "the request line and headers did not arrive "
                                            f"within {self.header_timeout:g} s; send them at once"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        if len(self.conn.trailing_data[0]) > self.max_head_bytes:  # h11 gave up on the head's size
            self._refuse(431, "Request Header Fields Too Large", self._head_message())
        else:
            self._refuse(400, "Bad Request", "invalid HTTP request: the request line or headers could not be parsed")


def uvicorn_config(app, limits: ServerLimits, *, host: str, port: int, log_level: str = "info",
                   **kwargs) -> uvicorn.Config:
    """A uvicorn.Config serving `app` with the guarded protocol and the limits' timeouts and header cap."""
    protocol = type("Guarded", (GuardedH11Protocol,), {"header_timeout": limits.header_timeout,
                                                       "max_head_bytes": limits.max_header_bytes})
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, http=protocol,
                          h11_max_incomplete_event_size=limits.max_header_bytes,
                          timeout_keep_alive=limits.timeout_keep_alive, **kwargs)
