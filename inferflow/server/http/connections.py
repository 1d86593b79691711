"""Connection limits of an API process: a cap on open connections, header and body timeouts.

uvicorn times out only idle keep-alive connections (after a response); a connection that never
sends a byte, or trickles its headers or body, is held forever, and enough of them exhaust the
process's file descriptors. ``ConnectionGuard`` wraps uvicorn's HTTP protocol (whichever
``http="auto"`` picks: httptools or h11) and adds, per connection:

- a **header timeout** (``server.timeout_header_s``): from the moment a connection waits for a
  request (just opened, or its previous response complete) until that request's headers are
  complete; past it the connection is closed. Trickling bytes does not extend it (slowloris).
- a **body timeout** (``server.timeout_body_s``): from complete headers until the whole body has
  arrived; past it the client gets ``408`` and the connection is closed.

and, per process, a **connection cap** (``server.max_connections``, split over the API
processes). At the cap a new connection evicts the oldest connection that is not being served
(waiting for a request, then receiving a body), the way nginx reuses idle keep-alive
connections when it runs out of them; only when every connection is being served is the new
one refused (``503`` + ``Retry-After``, closed). So idle and slow clients can never lock a
normal client out.

Each connection's state is read off uvicorn's own ``cycle`` after every ``data_received`` and
``on_response_complete`` (both parsers create the cycle when the headers are complete and clear
``more_body`` when the body is), so no parser callback is overridden.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from inferflow.config.server import ServerConfig

logger = logging.getLogger(__name__)

FD_HEADROOM = 1024  # descriptors kept free beyond the connection cap (queues, files, engines)
CAP_LOG_INTERVAL_S = 60.0


class ConnState(Enum):
    WAITING = "waiting"  # no request in progress: new connection, keep-alive, partial headers
    RECEIVING = "receiving"  # headers complete, body still arriving
    SERVING = "serving"  # request complete, response not yet sent in full


@dataclass
class _Conn:
    protocol: Any
    state: ConnState = ConnState.WAITING
    timer: asyncio.TimerHandle | None = None
    cycle: Any = None  # uvicorn's RequestResponseCycle this state was computed for


@dataclass
class ConnectionGuard:
    """Cap and timeouts for the connections of one API process (``None`` disables each)."""

    max_connections: int | None = 1024
    timeout_header_s: float | None = 15.0
    timeout_body_s: float | None = 30.0
    # counters (per process; logged, shown by tests)
    evicted: int = 0
    refused: int = 0
    timed_out: int = 0
    _conns: dict[int, _Conn] = field(default_factory=dict)  # id(protocol) -> state; oldest first
    _last_cap_log: float = 0.0

    def __len__(self) -> int:
        return len(self._conns)

    # --- hooks called by the protocol ---------------------------------------------------------
    def opened(self, protocol: Any) -> None:
        conn = _Conn(protocol)
        self._conns[id(protocol)] = conn
        if self.max_connections is not None and len(self._conns) > self.max_connections:
            victim = self._victim(exclude=conn)
            if victim is None:
                self.refused += 1
                self._log_cap("every connection is being served: refusing new ones (503)")
                _write_and_close(protocol, _raw_response(503, "server_busy", retry_after=1))
                return
            self.evicted += 1
            self._log_cap(f"closing the oldest {victim.state.value} connections for new ones")
            victim.protocol.transport.close()
        self._arm(conn)

    def progressed(self, protocol: Any) -> None:
        """Re-read the connection's state after uvicorn handled bytes or finished a response."""
        conn = self._conns.get(id(protocol))
        if conn is None:
            return
        cycle = getattr(protocol, "cycle", None)
        state = _state_of(cycle)
        if state is conn.state and cycle is conn.cycle:
            return  # e.g. more bytes of the same headers: the deadline stays where it was
        conn.state, conn.cycle = state, cycle
        self._arm(conn)

    def closed(self, protocol: Any) -> None:
        conn = self._conns.pop(id(protocol), None)
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()

    # --- internals ----------------------------------------------------------------------------
    def _victim(self, exclude: _Conn) -> _Conn | None:
        for wanted in (ConnState.WAITING, ConnState.RECEIVING):
            for conn in self._conns.values():  # insertion order: oldest first
                if conn is not exclude and conn.state is wanted:
                    return conn
        return None

    def _arm(self, conn: _Conn) -> None:
        if conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
        limit = {
            ConnState.WAITING: self.timeout_header_s,
            ConnState.RECEIVING: self.timeout_body_s,
            ConnState.SERVING: None,  # the request timeout (server.request_timeout_s) applies
        }[conn.state]
        if limit is not None:
            loop = asyncio.get_running_loop()
            conn.timer = loop.call_later(limit, self._expire, conn, conn.state)

    def _expire(self, conn: _Conn, state: ConnState) -> None:
        conn.timer = None
        if conn.state is not state or self._conns.get(id(conn.protocol)) is not conn:
            return
        self.timed_out += 1
        if state is ConnState.RECEIVING:
            body = _raw_response(408, "request_timeout", message="The request body took too long.")
            _write_and_close(conn.protocol, body)
        else:
            conn.protocol.transport.close()

    def _log_cap(self, what: str) -> None:
        now = time.monotonic()
        if now - self._last_cap_log >= CAP_LOG_INTERVAL_S:
            self._last_cap_log = now
            logger.warning(
                "connection cap reached (%d open, server.max_connections): %s "
                "(so far: %d evicted, %d refused)",
                len(self._conns),
                what,
                self.evicted,
                self.refused,
            )


def _state_of(cycle: Any) -> ConnState:
    if cycle is None or cycle.response_complete:
        return ConnState.WAITING
    return ConnState.RECEIVING if cycle.more_body else ConnState.SERVING


def _raw_response(
    status: int, code: str, message: str | None = None, retry_after: int | None = None
) -> bytes:
    reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
    text = message or "The server has too many open connections; retry shortly."
    body = json.dumps(
        {"error": {"message": text, "type": "server_error", "param": None, "code": code}}
    ).encode()
    head = [
        f"HTTP/1.1 {status} {reason}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "connection: close",
        *([f"retry-after: {retry_after}"] if retry_after is not None else []),
    ]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def _write_and_close(protocol: Any, data: bytes) -> None:
    transport = protocol.transport
    if not transport.is_closing():
        transport.write(data)
        transport.close()  # flushes the buffer first


def guarded_protocol(guard: ConnectionGuard) -> type[asyncio.Protocol]:
    """uvicorn's auto HTTP protocol class, reporting to ``guard`` (pass it as ``http=``)."""

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            guard.opened(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.closed(self)
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            guard.progressed(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            guard.progressed(self)

    return GuardedHTTPProtocol


def raise_fd_limit(max_connections: int | None) -> int | None:
    """Raise this process's soft descriptor limit so ``max_connections`` fit (the children
    inherit it); returns the connection cap that fits (lowered, with a warning, if it cannot)."""
    if max_connections is None:
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + FD_HEADROOM
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.debug("cannot raise RLIMIT_NOFILE to %d: %s", wanted, exc)
    if soft != resource.RLIM_INFINITY and soft - FD_HEADROOM < max_connections:
        fitted = max(64, soft - FD_HEADROOM)
        logger.warning(
            "server.max_connections=%d does not fit the descriptor limit (%d): using %d",
            max_connections,
            soft,
            fitted,
        )
        return fitted
    return max_connections


def uvicorn_connection_options(settings: ServerConfig, num_processes: int = 1) -> dict[str, Any]:
    """``uvicorn.Config`` keyword arguments for one of ``num_processes`` API processes."""
    cap = settings.max_connections
    per_process = None if cap is None else max(1, -(-cap // max(1, num_processes)))
    guard = ConnectionGuard(per_process, settings.timeout_header_s, settings.timeout_body_s)
    return {
        "http": guarded_protocol(guard),
        "timeout_keep_alive": settings.timeout_keep_alive_s,
    }
