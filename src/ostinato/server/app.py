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

import asyncio
import dataclasses
import json
import logging
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ostinato import __version__
from ostinato.config import quantization_label
from ostinato.engine.async_engine import AsyncEngine, EngineDeadError, EngineNotReadyError, RequestStream
from ostinato.engine.core_process import ProcessAsyncEngine
from ostinato.engine.chat_prompt import render_chat
from ostinato.engine.outputs import RequestOutput, merge_deltas
from ostinato.errors import InvalidRequestError
from ostinato.sampling_params import RequestOutputKind
from ostinato.server.engine_view import EngineView
from ostinato.server.errors import APIError, install_error_handlers
from ostinato.server.limits import ServerLimits
from ostinato.server.metrics import ServerMetrics
from ostinato.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware
from ostinato.server.protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionChoice, CompletionRequest, CompletionResponse, ErrorResponse, ModelCard,
                                      ModelList, UsageInfo, ChatCompletionChunk, streaming_responses)
from ostinato.server.streaming import (ChoiceCursor, EngineStreamResponse, Formatter, chat_events, completion_events,
                                       usage_of)
from ostinato.server.tool_calls import ToolRequest, template_messages
from ostinato.server.tool_stream import tool_chat_events

logger = logging.getLogger(__name__)

TOKENIZER_THREADS = 4  # concurrent tokenizations; each is bounded by the prompt character cap
GRAMMAR_CHECK_TIMEOUT_S = 10.0  # a response_format / structured_outputs grammar that compiles slower is refused


# ---- output formatting -------------------------------------------------------------------------------------
def _usage(out: RequestOutput, report_cached: bool) -> UsageInfo:
    completion = sum(len(c.token_ids) for c in out.outputs)
    return usage_of(len(out.prompt_token_ids), completion, out.num_cached_tokens if report_cached else None)


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


class _Serving:
    """What every route of one app shares: the engine, the limits, the served name and the tokenizer pool."""

    def __init__(self, async_engine: AsyncEngine | ProcessAsyncEngine, limits: ServerLimits, served_model_name: str,
                 report_cached_tokens: bool = True):
        self.async_engine, self.limits, self.name = async_engine, limits, served_model_name
        self.report_cached = report_cached_tokens
        self.draining = False  # set from the shutdown signal on (serve_command): /health says 503 draining
        # Tokenizing and chat templating run here: never on the event loop, never on the engine thread.
        self.tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="ostinato-tokenize")
        self._grammars = None  # the front's grammar compiler, when the engine core runs in another process

    def model_len(self) -> int | None:
        engine = self.async_engine
        return engine.engine.scheduler_config.max_model_len if engine.is_ready else None

    def engine(self):
        if self.draining:
            raise APIError(503, "the server is shutting down; retry (another instance will answer)",
                           "service_unavailable")
        if self.async_engine.dead_cause is not None:
            raise EngineDeadError(f"the engine is not serving: {self.async_engine.dead_cause}")
        stall = self.async_engine.stall_cause
        if stall is not None:
            raise APIError(503, f"the engine is not serving: {stall}; retry later", "service_unavailable")
        return self.async_engine.engine  # EngineNotReadyError while loading: 503

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.name!r} "
                           "(see GET /v1/models)", "not_found_error", param="model")

    def check_limits(self, body, logprobs: int | None) -> None:
        self.limits.check_sampling(n=body.n, stop=body.stop, stop_token_ids=body.stop_token_ids, logprobs=logprobs)

    async def off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    async def prompt_ids(self, engine, prompt: str | list[int]) -> str | list[int]:
        """The prompt as token ids, measured before and after tokenizing ("" is left to the engine's rule)."""
        max_len = engine.scheduler_config.max_model_len
        if isinstance(prompt, str) and prompt:
            self.limits.check_prompt_chars(len(prompt), max_len)
            prompt = await self.off_loop(engine.tokenizer.encode, prompt)  # as LLMEngine would encode it
        self.limits.check_prompt_tokens(len(prompt), max_len)
        return prompt

    @staticmethod
    def engine_params(params, cache_salt: str | None, request: Request):
        """The request's SamplingParams as the engine gets them: DELTA outputs (O(new tokens) per step, merged
        for a non-streamed answer), and a prefix-cache salt made of the API key's namespace and the body's
        cache_salt, so that only requests with the same key and salt share cached blocks."""
        namespace = request.scope.get("state", {}).get("cache_namespace")
        salt = None if namespace is None and cache_salt is None else json.dumps([namespace, cache_salt])
        return params.replace(output_kind=RequestOutputKind.DELTA, cache_salt=salt)

    async def check_constraint(self, engine, params) -> None:
        """Compile the request's grammar (bounded, in a pool: never on the event loop or the engine thread), so
        that a schema or regex that does not compile is a 400 naming its field before the request is queued."""
        spec = params.structured_outputs
        if spec is None:
            return
        grammars = getattr(engine, "constrained", None)  # the engine's own (and its cache), in this process
        if grammars is None:
            if self._grammars is None:
                from ostinato.engine.grammar import ConstrainedRequests

                self._grammars = ConstrainedRequests(engine.tokenizer, engine.model_config.vocab_size, (),
                                                     engine.args.tensor_parallel_size)
            grammars = self._grammars
        await self.off_loop(grammars.check, spec, GRAMMAR_CHECK_TIMEOUT_S)

    def stream_response(self, events: AsyncIterator[str], stream: RequestStream) -> Response:
        return EngineStreamResponse(events, stream, self.limits.stream_send_timeout)


def build_app(async_engine: AsyncEngine | ProcessAsyncEngine, *, api_key: str | Sequence[str] | None = None,
              served_model_name: str, max_body_bytes: int | None = None, limits: ServerLimits | None = None,
              isolate_keys: bool = True, report_cached_tokens: bool = True) -> FastAPI:
    """The FastAPI app serving `async_engine` (which may still be loading: /health says 503 until ready).

    `api_key`: one key or several, any of which /v1/* accepts; each key is its own prefix-cache namespace
    unless `isolate_keys` is False. `report_cached_tokens` False leaves usage.prompt_tokens_details out.

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
    serving = _Serving(async_engine, limits, served_model_name, report_cached_tokens)
    app.state.async_engine, app.state.metrics, app.state.limits = async_engine, metrics, limits
    app.state.serving = serving
    install_error_handlers(app)
    # Added last = outermost: the key is checked before a body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=lambda: limits.body_bytes(serving.model_len()),
                       timeout=limits.body_timeout)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or ())
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys, isolate=isolate_keys)
    _add_status_routes(app, serving, metrics)
    _add_completion_routes(app, serving)
    return app


def _add_status_routes(app: FastAPI, serving: _Serving, metrics: ServerMetrics) -> None:
    async_engine = serving.async_engine
    view = EngineView(async_engine)  # /health and /metrics never wait on the core for more than a second

    @app.get("/health")
    async def health() -> JSONResponse:
        if serving.draining:  # Connection: close, so a kept-alive probe reconnects (and is refused) next time
            return JSONResponse({"status": "draining"}, status_code=503, headers={"Connection": "close"})
        if async_engine.dead_cause is not None:
            return JSONResponse({"status": "dead", "cause": async_engine.dead_cause}, status_code=503)
        if async_engine.stall_cause is not None:
            return JSONResponse({"status": "stalled", "cause": async_engine.stall_cause}, status_code=503)
        if not async_engine.is_ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        stats, fresh = await view.stats()
        body = {"status": "ok", "model": serving.name, "cuda_graphs": async_engine.engine.graph_status}
        if not fresh:  # the core did not answer in time (yet not for the stall bound): the last answer
            body["engine_answered"] = False
        if stats is None:
            return JSONResponse(body)
        body.update(cuda_graphs_enabled=stats.graphs_enabled, captured_sizes=list(stats.captured_sizes),
                    batch_invariant=stats.batch_invariant)
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
            stats, _ = await view.stats()
        except (EngineNotReadyError, EngineDeadError):  # loading, or loading failed: the server's own only
            stats = None
        body, content_type = metrics.render(stats)
        return Response(body, media_type=content_type)

    @app.get("/v1/models", responses=_ERROR_RESPONSES)
    async def models() -> ModelList:
        engine = serving.engine()
        # root is the served name, never the model's folder: a client has no business knowing server paths.
        return ModelList(data=[ModelCard(id=serving.name, root=serving.name,
                                         max_model_len=engine.scheduler_config.max_model_len,
                                         quantization=quantization_label(engine.model_config.quantization))])


def _add_completion_routes(app: FastAPI, serving: _Serving) -> None:
    async_engine, limits, name = serving.async_engine, serving.limits, serving.name

    @app.post("/v1/completions", response_model=None,
              responses={**_ERROR_RESPONSES, **streaming_responses(CompletionResponse, CompletionResponse)})
    async def completions(body: CompletionRequest, request: Request) -> Response:
        engine = serving.engine()
        serving.check_model(body.model)
        params = serving.engine_params(body.to_sampling_params(engine.generation_defaults), body.cache_salt, request)
        serving.check_limits(body, params.logprobs)
        await serving.check_constraint(engine, params)
        prompt = await serving.prompt_ids(engine, body.single_prompt())
        request_id = f"cmpl-{uuid.uuid4().hex}"
        stream = await async_engine.add_request(request_id, prompt, params)
        fmt, want_logprobs = Formatter(engine.tokenizer), params.logprobs is not None
        if body.stream:
            return serving.stream_response(completion_events(stream, request_id, name, fmt, want_logprobs,
                                                              body.include_usage_chunk, serving.report_cached),
                                           stream)
        final = await _final_output(request, stream)
        if final is None:
            return Response(status_code=499)  # nobody is listening any more
        choices = []
        for c in final.outputs:
            lp = fmt.completion_logprobs(c, ChoiceCursor()) if want_logprobs else None
            choices.append(CompletionChoice(index=c.index, text=c.text, logprobs=lp, finish_reason=c.finish_reason))
        return JSONResponse(CompletionResponse(id=request_id, model=name, choices=choices,
                                               usage=_usage(final, serving.report_cached)).model_dump())

    @app.post("/v1/chat/completions", response_model=None,
              responses={**_ERROR_RESPONSES, **streaming_responses(ChatCompletionResponse, ChatCompletionChunk)})
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        engine = serving.engine()
        serving.check_model(body.model)
        template = getattr(engine.tokenizer, "chat_template", None)
        tools = ToolRequest.of(body.tools, body.tool_choice, template)
        messages = template_messages(body.messages, tools, template)
        max_len = engine.scheduler_config.max_model_len
        limits.check_prompt_chars(sum(len(m["content"]) for m in messages), max_len, param="messages")
        prompt = await serving.off_loop(_chat_prompt_ids, engine.tokenizer, messages,
                                        tools.template_kwargs(template) if tools else None)
        limits.check_prompt_tokens(len(prompt), max_len, param="messages")
        params = serving.engine_params(body.to_sampling_params(len(prompt), max_len, engine.generation_defaults),
                                       body.cache_salt, request)
        if tools is not None and tools.constraint() is not None:
            if params.structured_outputs is not None:
                raise InvalidRequestError("tool_choice 'required' or a named function constrains the output "
                                          "itself: leave out response_format / structured_outputs",
                                          param="tool_choice")
            params = params.replace(structured_outputs=tools.constraint())
        serving.check_limits(body, params.logprobs)
        await serving.check_constraint(engine, params)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = await async_engine.add_request(request_id, prompt, params)
        fmt, want_logprobs = Formatter(engine.tokenizer), params.logprobs is not None
        if body.stream:
            events = (tool_chat_events(stream, request_id, name, tools, params.n, body.include_usage_chunk,
                                       serving.report_cached)
                      if tools is not None else
                      chat_events(stream, request_id, name, fmt, want_logprobs, params.n, body.include_usage_chunk,
                                  serving.report_cached))
            return serving.stream_response(events, stream)
        final = await _final_output(request, stream)
        if final is None:
            return Response(status_code=499)
        choices = [_chat_choice(c, tools, fmt.chat_logprobs(c) if want_logprobs else None) for c in final.outputs]
        return JSONResponse(ChatCompletionResponse(id=request_id, model=name, choices=choices,
                                                   usage=_usage(final, serving.report_cached)).model_dump())


def _chat_choice(c, tools: ToolRequest | None, logprobs) -> ChatChoice:
    """One choice of a chat answer: its text, or the tool calls in it (finish_reason "tool_calls")."""
    if tools is None:
        return ChatChoice(index=c.index, message=AssistantMessage(content=c.text), logprobs=logprobs,
                          finish_reason=c.finish_reason)
    content, calls = tools.tool_calls(c.text)
    return ChatChoice(index=c.index, logprobs=logprobs,
                      message=AssistantMessage(content=content, tool_calls=[t.to_openai() for t in calls] or None),
                      finish_reason="tool_calls" if calls else c.finish_reason)


def _chat_prompt_ids(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The chat rendered by the model's template (with the assistant turn opened; `tools` among the template's
    arguments when it uses them), as token ids. Runs in the tokenizer pool: HF fast tokenizers mutate no state
    for encode/decode at fixed settings, so this is safe beside the engine thread's decoding."""
    return render_chat(tokenizer, messages, chat_template_kwargs=template_kwargs)[1]
