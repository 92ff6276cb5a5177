"""ASGI guards of the HTTP server: they run before a request's body is parsed."""

from __future__ import annotations

import asyncio
import hmac
from typing import Callable

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ostinato.server.errors import error_response

OPEN_PATHS = ("/health", "/metrics", "/version")  # never behind the API key (probes and scrapers)


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every path but /health, /metrics and /version."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        # compare_digest: the time taken must not tell an attacker how much of the key was right.
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._key):
            response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
                                      "key the server was started with (--api-key)", "authentication_error")
            return await response(scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for a body over `max_bytes()`, by Content-Length or by counting a streamed (chunked) body,
    and 408 for a body that does not arrive within `timeout` seconds (a slow client holds no request for ever).

    The body is read here (at most max_bytes are held) and replayed to the app; later `receive()` calls go to
    the server, so the app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int], timeout: float):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    @staticmethod
    def _too_large(limit: int) -> JSONResponse:
        return error_response(413, f"the request body exceeds the server's limit of {limit} bytes; "
                              "send a smaller request (or restart the server with a larger --max-body-bytes)",
                              "invalid_request_error")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        limit = self.max_bytes()
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return await self._too_large(limit)(scope, receive, send)
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    if size > limit:
                        return await self._too_large(limit)(scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            response = error_response(408, f"the request body did not arrive within {self.timeout:g} s; send it "
                                      "at once", "invalid_request_error", headers={"Connection": "close"})
            return await response(scope, receive, send)
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is not None:
                message, body = body, None
                return message
            return await receive()

        await self.app(scope, replay, send)
