"""How the HTTP server answers errors: OpenAI's body `{"error": {"message", "type", "param", "code"}}`, and
which status each of ostinato's typed errors maps to."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ostinato.engine.async_engine import EngineDeadError, EngineNotReadyError
from ostinato.errors import InvalidRequestError, QueueFullError
from ostinato.server.protocol import ErrorInfo, ErrorResponse

RETRY_AFTER_SECONDS = 1


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


def install_error_handlers(app: FastAPI) -> None:
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
