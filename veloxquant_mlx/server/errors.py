"""OpenAI-shaped errors and the one place HTTP statuses are decided."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from veloxquant_mlx.engine.types import (
    CAPACITY_REDUCED,
    DRAINING,
    REQUEST_FAILED,
    CapacityReducedError,
    EngineNotReadyError,
    FinishEvent,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
    rejection_of,
)
from veloxquant_mlx.server.access_log import note_error

log = logging.getLogger("veloxquant.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


# Every error code the server answers with, and its statuses. docs/api.md's error table is
# tested against this, and this against the codes the source uses (tests/server/test_docs.py).
ERROR_CODES: dict[str, tuple[int, ...]] = {
    "invalid_value": (400,),
    "invalid_request": (400,),
    "context_length_exceeded": (400,),
    "unsupported_value": (400,),
    "previous_response_not_found": (400,),
    "invalid_api_key": (401,),
    "model_not_found": (404,),
    "not_found": (404,),
    "method_not_allowed": (405,),
    "request_timeout": (408,),
    "body_too_large": (413,),
    "headers_too_large": (431,),
    "queue_full": (429,),
    "client_closed_request": (499,),
    "internal_error": (500,),
    "request_failed": (500,),
    "draining": (503,),
    "capacity_reduced": (503,),
    "engine_error": (503,),
    "engine_dead": (503,),
    "engine_stalled": (503,),
    "not_ready": (503,),
    "server_busy": (503,),
    "too_many_connections": (503,),
}


class APIError(Exception):
    """An error to answer in OpenAI's shape with ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        context: tuple[int, int, int] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = headers or {}
        self.context = context  # over the context window: (prompt, max_tokens, window)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


# Paths whose clients expect Anthropic's error shape (the Messages API).
ANTHROPIC_PATHS = ("/v1/messages",)


def speaks_anthropic(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    """``err`` in OpenAI's shape, or Anthropic's on the Messages API's paths; noted for the
    request's access-log line."""
    body = error_body(err.status, err.message, err.code, err.param)
    message = err.message
    if speaks_anthropic(path):
        from veloxquant_mlx.server.messages_api import anthropic_error, context_message

        message = err.message if err.context is None else context_message(*err.context)
        body = anthropic_error(err.status, message)
    note_error(err.code or str(err.status), message)
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def from_engine(exc: Exception) -> APIError:
    """The HTTP answer to an engine error."""
    if isinstance(exc, QueueFullError):
        return APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"})
    if isinstance(exc, RequestTooLargeError):
        return APIError(
            400, str(exc), code="context_length_exceeded", param="max_tokens", context=exc.context
        )
    if isinstance(exc, CapacityReducedError):
        return APIError(503, str(exc), code="capacity_reduced", headers={"Retry-After": "5"})
    if isinstance(exc, EngineNotReadyError):
        return APIError(503, str(exc), code="not_ready", headers={"Retry-After": "5"})
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), code="invalid_value", param=exc.param)
    raise exc


def from_finish(finish: FinishEvent) -> APIError:
    """The HTTP answer to a request that ended without a result ("error" or "cancelled").

    503 with Retry-After when another try (here later, or on another replica) can succeed:
    the pool was shrunk, the server is draining, the engine failed. 500 when this request's
    own sampler or text failed (a bug the input reached; the engine kept serving the rest).
    """
    refused = rejection_of(finish)  # decided by an engine in its own process
    if refused is not None:
        return from_engine(refused)
    if finish.finish_reason == "cancelled" and finish.error is None:
        # Only the route's own disconnect watcher cancels a request the route still waits on:
        # its client is gone, and this answer is for the access log (nginx's 499), not for it.
        return APIError(499, "the client closed the request", code="client_closed_request")
    message = finish.error or "the request was cancelled"
    if finish.error_code == REQUEST_FAILED:
        return APIError(500, message, code=REQUEST_FAILED)
    if finish.error_code == CAPACITY_REDUCED:
        return APIError(503, message, code=CAPACITY_REDUCED, headers={"Retry-After": "5"})
    if finish.error_code == DRAINING:
        return APIError(503, message, code=DRAINING, headers={"Retry-After": "1"})
    return APIError(503, message, code="engine_error", headers={"Retry-After": "5"})


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "[key]"}


def _param(loc: tuple[Any, ...]) -> str | None:
    """The field path a client wrote (``messages.0.content``), without pydantic's union member
    tags (``function-after[...]``, ``list[int]``) and dict keys (``logit_bias``)."""
    parts: list[str] = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, int):
            parts.append(str(p))
            continue
        if not isinstance(p, str) or not p.isidentifier() or "[" in p or p in _TYPE_TAGS:
            break
        parts.append(p)
    return ".".join(parts) or None


def describe_validation(errors: list[Any]) -> tuple[str, str | None]:
    """One message for the first invalid field: pydantic reports a union's failure once per
    member; those are joined (at most three)."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = _param(tuple(first.get("loc", ())))
    same = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    # A union's members that the value's type did not match say "should be a valid list";
    # when a member of the right type found a real problem, that is the one to report.
    about_value = [e for e in same if not str(e.get("type", "")).endswith("_type")]
    msgs: list[str] = []
    for e in about_value or same:
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        if msg not in msgs:
            msgs.append(msg)
    text = "; or ".join(msgs[:3]) if msgs else "invalid value"
    return (f"{param}: {text}" if param else text), param


def _not_served(path: str) -> str:
    """What a 404 says: for the APIs clients commonly try here, which ones to use instead."""
    if path == "/api" or path.startswith("/api/"):
        return (
            "Ollama's API is not served here; use the OpenAI API (/v1/chat/completions) or "
            "the Anthropic API (/v1/messages)"
        )
    if path.rstrip("/") == "/v1/embeddings":
        return "embeddings are not served here: this server generates text"
    return "no such endpoint"


def install(app: FastAPI) -> None:
    """Map every failure to OpenAI's error shape: 400 for validation (never 422)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(list(exc.errors()))
        err = APIError(400, message, code="invalid_value", param=param)
        return error_response(err, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        status, code = exc.status_code, None
        if status == 404:
            message, code = _not_served(request.url.path), "not_found"
        elif status == 405:
            message, code = "method not allowed on this endpoint", "method_not_allowed"
        else:
            message = str(exc.detail)
            code = "invalid_request" if status == 400 else None
        err = APIError(status, message, code=code, headers=dict(exc.headers or {}))
        return error_response(err, request.url.path)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        # A bug may have left the connection's state unknown: the client reconnects.
        return error_response(
            APIError(
                500, "internal server error", code="internal_error",
                headers={"Connection": "close"},
            ),
            request.url.path,
        )  # fmt: skip
