"""Errors in OpenAI's wire format: ``{"error": {"message", "type", "param", "code"}}``.

``ErrorInfo`` is a plain picklable dataclass, so the engine worker can send one through
LitServe's queues (a 504 timeout, a 500 engine failure); ``OpenAIError`` is the exception the
frontend raises and FastAPI turns into a JSON response (see ``install_error_handlers``).

An error names what the client sent (a field, a key, a version), and what a client sends can be
anything: a lone surrogate escape (not encodable as UTF-8, so rendering the error would fail
and turn a 400 into a 500), a NUL, a 10 KB key. ``ErrorInfo`` therefore stores its ``message``
and ``param`` already safe: lone surrogates written as ``\\udXXX`` escapes, and each bounded
(``MAX_MESSAGE_CHARS``, ``MAX_PARAM_CHARS``); ``field_name`` does the same for one key.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 4096  # an error message echoing a client's input stays this short
MAX_PARAM_CHARS = 256
MAX_NAME_CHARS = 64  # one key or name quoted from a request

# HTTP status -> OpenAI error ``type`` when the raiser does not name one.
_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


def safe_text(text: str, limit: int) -> str:
    """``text`` encodable as UTF-8 (a lone surrogate becomes its ``\\udXXX`` escape) and at
    most ``limit`` characters (cut ones end in ``...``)."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


def field_name(key: object) -> str:
    """One key of a request body as an error may quote it: safe and short."""
    return safe_text(str(key), MAX_NAME_CHARS)


def field_path(parts: list[str]) -> str:
    """A field's path (``messages.0.content``) from its keys, each quoted safely."""
    return ".".join(field_name(p) for p in parts)


@dataclass(frozen=True)
class ErrorInfo:
    """One API error. ``param`` names the offending request field (400s), ``retry_after_s``
    becomes a ``Retry-After`` header (429/503)."""

    status_code: int
    message: str
    type: str = ""
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", safe_text(self.message, MAX_MESSAGE_CHARS))
        if self.param is not None:
            object.__setattr__(self, "param", safe_text(self.param, MAX_PARAM_CHARS))

    @property
    def error_type(self) -> str:
        return self.type or _DEFAULT_TYPES.get(self.status_code, "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON object OpenAI clients parse (``openai.APIStatusError.body``)."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def sse_event(self) -> str:
        """The error as one Server-Sent Event (for a stream that fails after its 200 header)."""
        payload = self.body()
        payload["error"]["status_code"] = self.status_code
        return f"data: {json.dumps(payload)}\n\n"


# the queue (Manager) process died: in-flight requests fail with it (the API processes, and the
# worker once its request queue is gone), and the server exits for a supervisor to restart it
QUEUE_LOST = ErrorInfo(
    503,
    "The server lost its internal request queue (the queue process died) and is shutting "
    "down; retry once it is back.",
    code="queue_lost",
)


class OpenAIError(Exception):
    """Raised anywhere in the frontend; rendered as ``info.body()`` with ``info.status_code``."""

    def __init__(self, info: ErrorInfo) -> None:
        super().__init__(info.message)
        self.info = info

    @classmethod
    def of(cls, status_code: int, message: str, **kwargs: Any) -> OpenAIError:
        return cls(ErrorInfo(status_code, message, **kwargs))


def bad_request(message: str, param: str | None, code: str | None = None) -> OpenAIError:
    return OpenAIError.of(400, message, param=param, code=code)


def error_response(info: ErrorInfo) -> JSONResponse:
    return JSONResponse(info.body(), status_code=info.status_code, headers=info.response_headers())


async def _openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc.info)


async def _http_exception_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    info = ErrorInfo(exc.status_code, str(exc.detail), headers=dict(exc.headers or {}))
    return error_response(info)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    info = ErrorInfo(400, first.get("msg", "invalid request"), param=field_path(loc) or None)
    return error_response(info)


CLIENT_CLOSED = ErrorInfo(499, "the client closed the connection", code="client_closed")


async def _client_disconnect_handler(request: Request, exc: Exception) -> JSONResponse:
    """A client that hung up while sending its body: one debug line, no traceback (nobody is
    left to read the 499)."""
    logger.debug("client disconnected during %s %s", request.method, request.url.path)
    return error_response(CLIENT_CLOSED)


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ErrorInfo(500, "internal server error", code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaving ``app`` — ours, FastAPI's 404/405/422, or a bug — has OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(ClientDisconnect, _client_disconnect_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
