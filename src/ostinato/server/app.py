"""`ostinato serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an AsyncEngine.

Endpoints: POST /v1/completions and /v1/chat/completions (streaming as server-sent events), GET /v1/models,
/version, /health (200 with the CUDA-graph status when serving; 503 while loading or once the engine died)
and /metrics (Prometheus). Errors carry OpenAI's body `{"error": {"message", "type", "param", "code"}}`.

A client that goes away, also mid-stream, aborts its request so its KV blocks are freed at once: for streams
Starlette cancels the response on disconnect (and a send to a closed socket fails); for plain requests a
watcher on the ASGI receive channel cancels the wait. A client that stays connected but stops reading its
stream is aborted the same way once a send has waited --stream-send-timeout seconds (backpressure).

Hostile input (server/limits.py): every limit is checked before the work it bounds. A text prompt is measured
in characters before it is tokenized, and tokenization (and chat templating) runs in a small thread pool, off
the event loop and off the engine thread; the engine gets token ids.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import logging
import os
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ostinato import __version__
from ostinato.cli_args import add_engine_args, engine_args_from
from ostinato.engine.async_engine import AsyncEngine, EngineDeadError, EngineNotReadyError, RequestStream
from ostinato.engine.core_process import ProcessAsyncEngine, build_engine
from ostinato.engine.chat_prompt import render_chat
from ostinato.engine.outputs import RequestOutput, merge_deltas
from ostinato.errors import InvalidRequestError, QueueFullError
from ostinato.sampling_params import RequestOutputKind
from ostinato.server.limits import ServerLimits, add_limit_args, limits_from
from ostinato.server.metrics import ServerMetrics
from ostinato.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse, CompletionChoice,
                       CompletionRequest, CompletionResponse, ErrorInfo, ErrorResponse, ModelCard, ModelList,
                       UsageInfo)
from ostinato.server.streaming import ChoiceCursor, EngineStreamResponse, Formatter, chat_events, completion_events, usage_of

logger = logging.getLogger(__name__)

RETRY_AFTER_SECONDS = 1
TOKENIZER_THREADS = 4  # concurrent tokenizations; each is bounded by the prompt character cap
_OPEN_PATHS = ("/health", "/metrics", "/version")  # never behind the API key (probes and scrapers)


# ---- errors ------------------------------------------------------------------------------------------------
class APIError(Exception):
    """An error answered with OpenAI's error body and the given HTTP status."""

    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param, self.headers = status, message, err_type, param, headers


def error_response(status: int, message: str, err_type: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if errors and errors[0].get("type") == "json_invalid":
        return f"the request body is not valid JSON: {errors[0].get('ctx', {}).get('error', '')}".rstrip(": "), None
    if errors and tuple(errors[0].get("loc", ())) == ("body",):
        # FastAPI parses only JSON content types; anything else arrives as raw bytes.
        return "the request body must be a JSON object, sent with 'Content-Type: application/json'", None
    parts, param = [], None
    for err in errors[:5]:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = param or (loc[0] if loc else None)
        parts.append(f"{'.'.join(loc) or 'body'}: {str(err.get('msg')).removeprefix('Value error, ')}")
    return "invalid request: " + "; ".join(parts), param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.err_type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # OpenAI answers a bad body with 400, not FastAPI's 422.
        message, param = _validation_message(exc)
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(QueueFullError)
    async def _queue_full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(429, str(exc) or "the server's waiting queue is full; retry later",
                              "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(EngineDeadError)
    async def _dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "service_unavailable")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after answering, so uvicorn logs the traceback; the client learns nothing of the
        # internals (an exception's text may hold paths, tokens of other requests, or library details).
        return error_response(500, "internal server error; the server log has the details", "internal_error")

    @app.exception_handler(EngineNotReadyError)
    async def _loading(_: Request, exc: EngineNotReadyError) -> JSONResponse:
        return error_response(503, "the model is still loading; retry when GET /health returns 200",
                              "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), err_type, headers=exc.headers)


# ---- ASGI guards (they run before the body is parsed) ------------------------------------------------------
class ApiKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on every path but /health, /metrics and /version."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self._key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
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


# ---- output formatting -------------------------------------------------------------------------------------
def _usage(out: RequestOutput) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return usage_of(len(out.prompt_token_ids), completion, out.num_cached_tokens)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _final_output(request: Request, stream: RequestStream) -> RequestOutput | None:
    """The request's whole output (its DELTA outputs merged), or None if the client disconnected first (the
    request is then aborted)."""

    async def collect() -> RequestOutput:
        deltas = [out async for out in stream]
        if not deltas or not deltas[-1].finished:
            raise EngineDeadError("the request was aborted before it finished")
        return merge_deltas(deltas)

    consumer = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return consumer.result() if consumer.done() else None
    finally:
        consumer.cancel()
        watcher.cancel()
        stream.close()


# ---- the app -----------------------------------------------------------------------------------------------
_ERROR_RESPONSES = {status: {"model": ErrorResponse, "description": text} for status, text in (
    (400, "invalid request (a bad value, a limit exceeded); names the parameter"),
    (401, "missing or wrong API key"), (404, "unknown model"), (408, "the body arrived too slowly"),
    (413, "the body exceeds --max-body-bytes"), (429, "the waiting queue is full (Retry-After)"),
    (500, "internal error"), (503, "loading, or the engine stopped"))}


def _openapi_without_422(app: FastAPI) -> Callable[[], dict]:
    """FastAPI documents its 422 validation error on every route with a body; this server answers 400 (the
    handler above), so the schema says 400 and drops the unused validation-error schemas."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def build_app(async_engine: AsyncEngine | ProcessAsyncEngine, *, api_key: str | None = None, served_model_name: str,
              max_body_bytes: int | None = None, limits: ServerLimits | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` (which may still be loading: /health says 503 until ready).

    `limits` bounds what one request may ask (default: ServerLimits()); `max_body_bytes`, if given, overrides
    its body cap. Installs a ServerMetrics as the engine's step observer; its registry is
    `app.state.metrics.registry`.
    """
    limits = limits or ServerLimits()
    if max_body_bytes is not None:
        limits = dataclasses.replace(limits, max_body_bytes=max_body_bytes)
    app = FastAPI(title="ostinato", version=__version__)
    app.openapi = _openapi_without_422(app)
    metrics = ServerMetrics(served_model_name)
    async_engine.observer = metrics
    app.state.async_engine, app.state.metrics, app.state.limits = async_engine, metrics, limits
    # Tokenizing and chat templating run here: never on the event loop, never on the engine thread.
    tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="ostinato-tokenize")
    _install_error_handlers(app)

    def model_len() -> int | None:
        return async_engine.engine.scheduler_config.max_model_len if async_engine.is_ready else None

    # Added last = outermost: the key is checked before a body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=lambda: limits.body_bytes(model_len()),
                       timeout=limits.body_timeout)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    def serving_engine():
        if async_engine.dead_cause is not None:
            raise EngineDeadError(f"the engine is not serving: {async_engine.dead_cause}")
        return async_engine.engine  # EngineNotReadyError while loading: 503

    def check_model(model: str | None) -> None:
        if model is not None and model != served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {served_model_name!r} "
                           "(see GET /v1/models)", "not_found_error", param="model")

    def check_limits(body, logprobs: int | None) -> None:
        limits.check_sampling(n=body.n, stop=body.stop, stop_token_ids=body.stop_token_ids, logprobs=logprobs)

    async def off_loop(fn, *args):
        return await asyncio.get_running_loop().run_in_executor(tokenizer_pool, fn, *args)

    async def prompt_ids(engine, prompt: str | list[int]) -> str | list[int]:
        """The prompt as token ids, measured before and after tokenizing ("" is left to the engine's rule)."""
        max_len = engine.scheduler_config.max_model_len
        if isinstance(prompt, str) and prompt:
            limits.check_prompt_chars(len(prompt), max_len)
            prompt = await off_loop(engine.tokenizer.encode, prompt)  # as LLMEngine would encode it
        limits.check_prompt_tokens(len(prompt), max_len)
        return prompt

    def stream_response(events: AsyncIterator[str], stream: RequestStream) -> Response:
        return EngineStreamResponse(events, stream, limits.stream_send_timeout)

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.dead_cause is not None:
            return JSONResponse({"status": "dead", "cause": async_engine.dead_cause}, status_code=503)
        if not async_engine.is_ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        stats = await async_engine.get_stats()
        body = {"status": "ok", "model": served_model_name, "cuda_graphs": async_engine.engine.graph_status,
                "cuda_graphs_enabled": stats.graphs_enabled, "captured_sizes": list(stats.captured_sizes)}
        if stats.ranks:  # tensor parallelism: every rank must be alive to serve
            body["ranks"] = list(stats.ranks)
            if not all(r["alive"] for r in stats.ranks):
                return JSONResponse({**body, "status": "dead"}, status_code=503)
        return JSONResponse(body)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        try:
            stats = await async_engine.get_stats()
        except (EngineNotReadyError, EngineDeadError):  # loading, or loading failed: the server's own only
            stats = None
        body, content_type = metrics.render(stats)
        return Response(body, media_type=content_type)

    @app.get("/v1/models", responses=_ERROR_RESPONSES)
    async def models() -> ModelList:
        engine = serving_engine()
        # root is the served name, never the model's folder: a client has no business knowing server paths.
        return ModelList(data=[ModelCard(id=served_model_name, root=served_model_name,
                                         max_model_len=engine.scheduler_config.max_model_len)])

    @app.post("/v1/completions", response_model=None, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = serving_engine()
        check_model(body.model)
        params = _as_delta(body.to_sampling_params())
        check_limits(body, params.logprobs)
        prompt = await prompt_ids(engine, body.single_prompt())
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await async_engine.add_request(request_id, prompt, params)
        fmt, want_logprobs = Formatter(engine.tokenizer), params.logprobs is not None
        if body.stream:
            return stream_response(completion_events(stream, request_id, served_model_name, fmt, want_logprobs,
                                                      body.include_usage_chunk), stream)
        final = await _final_output(request, stream)
        if final is None:
            return Response(status_code=499)  # nobody is listening any more
        choices = []
        for c in final.outputs:
            lp = fmt.completion_logprobs(c, ChoiceCursor()) if want_logprobs else None
            choices.append(CompletionChoice(index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason))
        return JSONResponse(CompletionResponse(id=request_id, model=served_model_name, choices=choices,
                                               usage=_usage(final)).model_dump())

    @app.post("/v1/chat/completions", response_model=None, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        engine = serving_engine()
        check_model(body.model)
        messages = body.template_messages()
        max_len = engine.scheduler_config.max_model_len
        limits.check_prompt_chars(sum(len(m["content"]) for m in messages), max_len, param="messages")
        prompt = await off_loop(_chat_prompt_ids, engine.tokenizer, messages)
        limits.check_prompt_tokens(len(prompt), max_len, param="messages")
        params = _as_delta(body.to_sampling_params(len(prompt), max_len))
        check_limits(body, params.logprobs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await async_engine.add_request(request_id, prompt, params)
        fmt, want_logprobs = Formatter(engine.tokenizer), params.logprobs is not None
        if body.stream:
            return stream_response(chat_events(stream, request_id, served_model_name, fmt, want_logprobs,
                                                params.n, body.include_usage_chunk), stream)
        final = await _final_output(request, stream)
        if final is None:
            return Response(status_code=499)
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                              logprobs=fmt.chat_logprobs(c) if want_logprobs else None,
                              finish_reason=c.finish_reason) for c in final.outputs]
        return JSONResponse(ChatCompletionResponse(id=request_id, model=served_model_name, choices=choices,
                                                   usage=_usage(final)).model_dump())

    return app


def _as_delta(params):
    """The server streams (and merges non-streamed answers from) DELTA outputs: O(new tokens) per step."""
    return params.replace(output_kind=RequestOutputKind.DELTA)


def _chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The chat rendered by the model's template (with the assistant turn opened), as token ids. Runs in the
    tokenizer pool: HF fast tokenizers mutate no state for encode/decode at fixed settings, so this is safe
    beside the engine thread's decoding."""
    return render_chat(tokenizer, messages)[1]


# ---- the command -------------------------------------------------------------------------------------------
def register(subparsers) -> None:
    """Add `ostinato serve MODEL_DIR ...` to the CLI."""
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                              description=__doc__.split("\n\n")[0])
    add_engine_args(p)
    p.add_argument("--host", default="0.0.0.0", help="address to bind (default: all interfaces)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OSTINATO_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $OSTINATO_API_KEY)")
    add_limit_args(p)
    p.add_argument("--engine-thread", action="store_true",
                   help="run the engine on a thread of the server's process instead of in its own process "
                        "(slower: the engine and the HTTP work then share one GIL)")
    p.set_defaults(func=run)


_UVICORN_LOG_LEVELS = {"CRITICAL": "critical", "ERROR": "error", "WARNING": "warning", "WARN": "warning",
                       "INFO": "info", "DEBUG": "debug"}


def run(ns: argparse.Namespace, engine_factory=build_engine) -> int:
    """Load the model in the engine core process (or on the engine thread, --engine-thread) while uvicorn
    already answers /health (503), then serve. engine_factory(EngineArgs) builds the engine; for the core
    process it must be a module-level function (spawn pickles it by name)."""
    import uvicorn

    from ostinato.server.http import uvicorn_config

    args = engine_args_from(ns)  # a ConfigError reaches the CLI, which prints it (exit code 2)
    limits = limits_from(ns)
    name = args.served_model_name or Path(args.model).resolve().name  # the name LLMEngine gives it
    if getattr(ns, "engine_thread", False):
        async_engine = AsyncEngine(lambda: engine_factory(args))
    else:
        async_engine = ProcessAsyncEngine(args, factory=engine_factory)
    app = build_app(async_engine, api_key=ns.api_key, served_model_name=name, limits=limits)
    log_level = _UVICORN_LOG_LEVELS.get(str(getattr(ns, "log_level", "INFO")).upper(), "info")
    server = uvicorn.Server(uvicorn_config(app, limits, host=ns.host, port=ns.port, log_level=log_level))

    async def main() -> int:
        async_engine.start()
        serving = asyncio.create_task(server.serve())
        ready = asyncio.create_task(async_engine.wait_ready())
        await asyncio.wait({serving, ready}, return_when=asyncio.FIRST_COMPLETED)
        if ready.done() and ready.exception() is not None:
            cause = ready.exception().__cause__ or ready.exception()
            logger.error("ostinato could not start: %s", cause)
            server.should_exit = True
            await serving
            return 1
        if ready.done():
            port = server.servers[0].sockets[0].getsockname()[1] if server.servers else ns.port
            logger.info("serving %s on http://%s:%d; CUDA graphs: %s", name, ns.host, port,
                        async_engine.engine.graph_status)
        await serving
        return 0

    try:
        return asyncio.run(main())
    finally:
        async_engine.shutdown()
