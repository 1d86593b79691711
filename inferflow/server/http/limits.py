"""Admission checks of the frontend: API keys (401), payload size (413), rate limits (429).

Everything here runs on the API process's event loop thread, so it needs no locks. Rate limits
are token buckets per API key (one shared bucket when the API is open), refilled continuously:
``requests_per_minute`` counts requests, ``tokens_per_minute`` counts prompt + ``max_tokens``
(the tokens a request may consume, as OpenAI accounts them). With several API processes each
keeps its own buckets.
"""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflow.server.http.errors import ErrorInfo, OpenAIError

OPEN_ACCESS = "anonymous"


class ApiKeyAuth:
    """Bearer-token check against the configured keys; open when there are none."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self._keys = [(key.encode(), f"key-{i}") for i, key in enumerate(keys)]

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The id of the key that authenticated (never the key itself); raises a 401."""
        if not self._keys:
            return OPEN_ACCESS
        presented = _presented_key(headers)
        if presented is None:
            raise OpenAIError.of(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                type="invalid_request_error",
                code="invalid_api_key",
            )
        token = presented.encode()
        for key, key_id in self._keys:
            if hmac.compare_digest(token, key):
                return key_id
        raise OpenAIError.of(
            401, "Incorrect API key provided.", type="invalid_request_error", code="invalid_api_key"
        )


def _presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class TokenBucket:
    """``capacity`` units per minute, refilled continuously; starts full."""

    def __init__(self, capacity: int) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / 60.0  # units per second
        self.level = float(capacity)
        self.stamp = time.monotonic()

    def take(self, amount: float) -> float:
        """Take ``amount`` now and return 0, or take nothing and return the seconds to wait."""
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        if amount <= self.level:
            self.level -= amount
            return 0.0
        if amount > self.capacity or self.rate == 0:
            return 60.0
        return (amount - self.level) / self.rate


class RateLimiter:
    """Per-key request and token limits (``None`` disables one)."""

    def __init__(self, requests_per_minute: int | None, tokens_per_minute: int | None) -> None:
        self.rpm, self.tpm = requests_per_minute, tokens_per_minute
        self._requests: dict[str, TokenBucket] = {}
        self._tokens: dict[str, TokenBucket] = {}

    def check_request(self, key_id: str) -> None:
        if self.rpm is None:
            return
        bucket = self._requests.setdefault(key_id, TokenBucket(self.rpm))
        wait = bucket.take(1)
        if wait:
            raise OpenAIError(
                ErrorInfo(
                    429,
                    f"Rate limit reached for requests per minute (limit {self.rpm}); "
                    f"retry in {wait:.1f} s.",
                    type="requests",
                    code="rate_limit_exceeded",
                    retry_after_s=wait,
                )
            )

    def refund_request(self, key_id: str) -> None:
        """Give back the request token of a request refused later (a 429 costs nothing)."""
        bucket = self._requests.get(key_id)
        if bucket is not None:
            bucket.level = min(bucket.capacity, bucket.level + 1)

    def check_tokens(self, key_id: str, tokens: int) -> None:
        if self.tpm is None:
            return
        bucket = self._tokens.setdefault(key_id, TokenBucket(self.tpm))
        wait = bucket.take(tokens)
        if wait:
            raise OpenAIError(
                ErrorInfo(
                    429,
                    f"Rate limit reached for tokens per minute (limit {self.tpm}, requested "
                    f"{tokens}); retry in {wait:.1f} s.",
                    type="tokens",
                    code="rate_limit_exceeded",
                    retry_after_s=wait,
                )
            )


def payload_too_large(limit: int) -> ErrorInfo:
    return ErrorInfo(
        413, f"The request body exceeds the limit of {limit} bytes.", code="payload_too_large"
    )


class PayloadLimitMiddleware:
    """Pure ASGI middleware: a body over ``max_bytes`` gets a 413 in OpenAI's format.

    A declared ``Content-Length`` over the limit is refused before reading anything; a chunked
    body is counted as it arrives and the handler's read fails with the same 413.
    """

    def __init__(self, app: ASGIApp, max_bytes: int | None) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes is None:
            await self.app(scope, receive, send)
            return
        limit = self.max_bytes
        declared = dict(scope.get("headers", ())).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _send_json(send, payload_too_large(limit))
            return
        seen = 0

        async def counting_receive() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise OpenAIError(payload_too_large(limit))
            return message

        await self.app(scope, counting_receive, send)


DOCS_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class DocsKeyMiddleware:
    """Pure ASGI middleware: with API keys on, FastAPI's docs and schema routes need a key too
    (they describe the API to anyone who asks otherwise); a 401 in OpenAI's format."""

    def __init__(self, app: ASGIApp, auth: ApiKeyAuth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path") in DOCS_PATHS:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
            try:
                self.auth.authenticate(headers)
            except OpenAIError as exc:
                await _send_json(send, exc.info, close=False)
                return
        await self.app(scope, receive, send)


async def _send_json(send: Send, info: ErrorInfo, close: bool = True) -> None:
    body = json.dumps(info.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *([(b"connection", b"close")] if close else []),
        *((k.encode("latin-1"), v.encode("latin-1")) for k, v in info.response_headers().items()),
    ]
    await send({"type": "http.response.start", "status": info.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
