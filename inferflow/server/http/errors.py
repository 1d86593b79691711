"""Errors in OpenAI's wire format: ``{"error": {"message", "type", "param", "code"}}``.

``OpenAIError`` is the exception the frontend raises and FastAPI turns into a JSON response
(see ``install_error_handlers``); it carries an ``ErrorInfo`` (``server/messages.py``: the
picklable error that also crosses processes). ``field_name`` makes one key a client sent safe
and short to quote, as ``ErrorInfo`` does for its message and param.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from inferflow.server.messages import ErrorInfo, safe_text

logger = logging.getLogger(__name__)

MAX_NAME_CHARS = 64  # one key or name quoted from a request


def field_name(key: object) -> str:
    """One key of a request body as an error may quote it: safe and short."""
    return safe_text(str(key), MAX_NAME_CHARS)


def field_path(parts: list[str]) -> str:
    """A field's path (``messages.0.content``) from its keys, each quoted safely."""
    return ".".join(field_name(p) for p in parts)


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
