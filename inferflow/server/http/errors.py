"""Errors in OpenAI's wire format: ``{"error": {"message", "type", "param", "code"}}``.

``ErrorInfo`` is a plain picklable dataclass, so the engine worker can send one through
LitServe's queues (a 504 timeout, a 500 engine failure); ``OpenAIError`` is the exception the
frontend raises and FastAPI turns into a JSON response (see ``install_error_handlers``).
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

logger = logging.getLogger(__name__)

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
    info = ErrorInfo(400, first.get("msg", "invalid request"), param=".".join(loc) or None)
    return error_response(info)


async def _unhandled_handler(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(ErrorInfo(500, "internal server error", code="internal_error"))


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaving ``app`` — ours, FastAPI's 404/405/422, or a bug — has OpenAI's shape."""
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
