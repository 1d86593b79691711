"""Admission checks of the frontend: API and admin keys (401/403), payload size (413), rate limits
(429).

Rate limits are token buckets per API key (one bucket when the API is open), refilled
continuously: ``requests_per_minute`` counts requests, ``tokens_per_minute`` counts prompt +
``max_tokens`` (the tokens a request may consume, as OpenAI accounts them). The buckets live in
shared memory, created before the API processes fork, so the limits hold for the server as a
whole however many API processes share the port (one lock guards them; ``time.monotonic`` is
the same clock in every process).
"""

from __future__ import annotations

import hmac
import json
import multiprocessing as mp
import time
from collections.abc import Iterable, Mapping

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferflow.config.server import ServerConfig
from inferflow.server.http.errors import OpenAIError
from inferflow.server.messages import ErrorInfo

OPEN_ACCESS = "anonymous"


class ApiKeyAuth:
    """Bearer-token checks against the configured keys.

    ``authenticate`` guards every keyed route but the admin ones: open without ``keys``, else
    an API key or an admin key. ``authorize_admin`` guards the admin routes: open only when no
    key of either kind is configured, else an admin key (an API key is a 403; with ``keys`` but
    no ``admin_keys`` every key is a 403: the admin role is off until it is given keys). Key
    ids, never the keys, name the caller (rate limits): ``key-<i>`` and ``admin-<i>``.
    """

    def __init__(self, keys: tuple[str, ...], admin_keys: tuple[str, ...] = ()) -> None:
        self._keys = [(key.encode(), f"key-{i}") for i, key in enumerate(keys)]
        self._admin = [(key.encode(), f"admin-{i}") for i, key in enumerate(admin_keys)]

    @classmethod
    def for_server(cls, settings: ServerConfig) -> ApiKeyAuth:
        """The keys of ``settings`` (``ServerConfig.with_env_api_keys()``: env keys added)."""
        return cls(tuple(settings.api_keys), tuple(settings.admin_keys))

    @property
    def key_ids(self) -> list[str]:
        """Every id ``authenticate`` can return."""
        api_ids = [key_id for _, key_id in self._keys] or [OPEN_ACCESS]
        return api_ids + [key_id for _, key_id in self._admin]

    def authenticate(self, headers: Mapping[str, str]) -> str:
        """The id of the key that authenticated (never the key itself); raises a 401."""
        if not self._keys:
            return OPEN_ACCESS
        token = _required_key(headers)
        key_id = _match(token, self._keys) or _match(token, self._admin)
        if key_id is None:
            raise _incorrect_key()
        return key_id

    def authorize_admin(self, headers: Mapping[str, str]) -> str:
        """The admin key's id (``OPEN_ACCESS`` with no keys at all); a 401 for a missing or
        unknown key, a 403 for an API key."""
        if not self._keys and not self._admin:
            return OPEN_ACCESS
        token = _required_key(headers)
        key_id = _match(token, self._admin)
        if key_id is not None:
            return key_id
        if _match(token, self._keys) is None:
            raise _incorrect_key()
        needed = (
            "This route needs an admin key (server.admin_keys); an API key cannot use it."
            if self._admin
            else "The admin routes are disabled while server.api_keys is set and "
            "server.admin_keys is empty: set server.admin_keys (or $INFERFLOW_ADMIN_KEYS)."
        )
        raise OpenAIError.of(403, needed, type="permission_error", code="admin_key_required")


def _required_key(headers: Mapping[str, str]) -> bytes:
    presented = _presented_key(headers)
    if presented is None:
        raise OpenAIError.of(
            401,
            "Missing API key: send it as 'Authorization: Bearer <key>'.",
            type="invalid_request_error",
            code="invalid_api_key",
        )
    return presented.encode()


def _match(token: bytes, keys: list[tuple[bytes, str]]) -> str | None:
    """The id of the key equal to ``token`` (compared in constant time), if any."""
    return next((key_id for key, key_id in keys if hmac.compare_digest(token, key)), None)


def _incorrect_key() -> OpenAIError:
    return OpenAIError.of(
        401, "Incorrect API key provided.", type="invalid_request_error", code="invalid_api_key"
    )


def _presented_key(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    return headers.get("x-api-key") or None


class SharedBuckets:
    """Token buckets of ``capacity`` units per minute, one per name, refilled continuously and
    starting full; in shared memory, so every process forked after creating them spends from
    the same buckets."""

    def __init__(self, capacity: int, names: Iterable[str]) -> None:
        self.capacity = float(capacity)
        self.rate = capacity / 60.0  # units per second
        self._slot = {name: i for i, name in enumerate(dict.fromkeys(names))}
        now = time.monotonic()
        initial = [v for _ in self._slot for v in (self.capacity, now)]  # [level, stamp] per name
        self._cells = mp.get_context("spawn").Array("d", initial)  # with its own lock

    def take(self, name: str, amount: float) -> float:
        """Take ``amount`` now and return 0, or take nothing and return the seconds to wait."""
        i = 2 * self._slot[name]
        with self._cells.get_lock():
            now = time.monotonic()
            level = min(self.capacity, self._cells[i] + (now - self._cells[i + 1]) * self.rate)
            self._cells[i + 1] = now
            if amount <= level:
                self._cells[i] = level - amount
                return 0.0
            self._cells[i] = level
        if amount > self.capacity or self.rate == 0:
            return 60.0
        return (amount - level) / self.rate

    def give_back(self, name: str, amount: float) -> None:
        i = 2 * self._slot[name]
        with self._cells.get_lock():
            self._cells[i] = min(self.capacity, self._cells[i] + amount)


class RateLimiter:
    """Per-key request and token limits (``None`` disables one) for the key ids ``key_ids``
    (``ApiKeyAuth.key_ids``), shared by every API process forked after it is created."""

    def __init__(
        self,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        key_ids: Iterable[str] = (OPEN_ACCESS,),
    ) -> None:
        self.rpm, self.tpm = requests_per_minute, tokens_per_minute
        ids = list(key_ids)
        self._requests = None if self.rpm is None else SharedBuckets(self.rpm, ids)
        self._tokens = None if self.tpm is None else SharedBuckets(self.tpm, ids)

    def check_request(self, key_id: str, count: int = 1) -> None:
        """Charge ``count`` requests (each engine request of a fanned-out one counts)."""
        if self._requests is None:
            return
        wait = self._requests.take(key_id, count)
        if wait:
            raise OpenAIError.of(
                429,
                f"Rate limit reached for requests per minute (limit {self.rpm}); "
                f"retry in {wait:.1f} s.",
                type="requests",
                code="rate_limit_exceeded",
                retry_after_s=wait,
            )

    def refund_request(self, key_id: str, count: int = 1) -> None:
        """Give back the request tokens of a request refused later (a 429 costs nothing)."""
        if self._requests is not None:
            self._requests.give_back(key_id, count)

    def check_tokens(self, key_id: str, tokens: int) -> None:
        if self._tokens is None:
            return
        wait = self._tokens.take(key_id, tokens)
        if wait:
            raise OpenAIError.of(
                429,
                f"Rate limit reached for tokens per minute (limit {self.tpm}, requested "
                f"{tokens}); retry in {wait:.1f} s.",
                type="tokens",
                code="rate_limit_exceeded",
                retry_after_s=wait,
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
