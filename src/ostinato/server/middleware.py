"""ASGI guards of the HTTP server: they run before a request's body is parsed."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
from pathlib import Path
from typing import Callable, Sequence

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ostinato.errors import ConfigError
from ostinato.server.errors import error_response

OPEN_PATHS = ("/health", "/metrics", "/version")  # never behind the API key (probes and scrapers)


def read_api_keys(path: str | Path) -> list[str]:
    """The keys of an --api-keys-file: one per line; blank lines and lines starting with '#' are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"--api-keys-file {path}: cannot read it ({e.strerror})") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ConfigError(f"--api-keys-file {path} holds no key; write one key per line")
    return keys


def key_namespace(key: str) -> str:
    """A key's prefix-cache namespace: a digest, so the key itself never travels to the engine."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>`, with one of `api_keys`, on every path but /health, /metrics and
    /version. With `isolate` (the default) the request's scope["state"]["cache_namespace"] names its key, so
    each key gets its own prefix cache (a client cannot learn through cached_tokens or timing what a holder
    of another key sent); without it every key shares one."""

    def __init__(self, app: ASGIApp, api_keys: Sequence[str], isolate: bool = True):
        if not api_keys or not all(api_keys):
            raise ConfigError("every API key must be a non-empty string")
        self.app, self._isolate = app, isolate
        self._keys = [(key.encode(), key_namespace(key)) for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        auth = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        token, namespace = token.strip(), None
        # compare_digest against every key, without stopping at a match: the time taken must tell an attacker
        # neither how much of a key was right nor which key matched.
        for key, key_ns in self._keys:
            if hmac.compare_digest(token, key):
                namespace = key_ns
        if scheme.lower() != b"bearer" or namespace is None:
            response = error_response(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with a "
                                      "key the server was started with (--api-key, --api-keys-file)",
                                      "authentication_error")
            return await response(scope, receive, send)
        if self._isolate:
            scope.setdefault("state", {})["cache_namespace"] = namespace
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
