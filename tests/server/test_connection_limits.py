"""Connection cap and header/body timeouts (``inferflow.server.http.connections``).

A real server with a small cap and short timeouts, probed with raw loopback sockets: silent,
trickling and slow-body connections beyond the cap never keep a normal client from being served,
and each kind is closed (or answered 408) once its timeout passes. The guard's bookkeeping is
also checked directly, with fake protocols, for the case a live test cannot stage cheaply:
every connection busy, so the new one is refused with a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
from server_harness import MODEL, ServerProcess, start_server

from inferflow.server.http.connections import ConnectionGuard, ConnState

pytestmark = [pytest.mark.server, pytest.mark.slow]

CAP, HEADER_S, BODY_S = 12, 2.0, 2.0


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory,
        "connections",
        [
            f"server.max_connections={CAP}",
            f"server.timeout_header_s={HEADER_S}",
            f"server.timeout_body_s={BODY_S}",
        ],
    )
    yield srv
    srv.terminate()


def _connect(srv: ServerProcess) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing, or None if it is still open after ``seconds``."""
    sock.settimeout(0.2)
    received = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk
    return None


def test_idle_and_slow_connections_beyond_the_cap_do_not_lock_out_a_client(
    guarded_server: ServerProcess,
) -> None:
    srv = guarded_server
    silent = [_connect(srv) for _ in range(3 * CAP)]  # never send a byte
    trickling = [_connect(srv) for _ in range(CAP)]
    for sock in trickling:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finish
    try:
        for _ in range(3):  # a normal client, several times, each on a fresh connection
            out = srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert out.choices[0].finish_reason == "length"
        assert srv.get("/ready").status_code == 200
        # the oldest idle ones were closed to make room: at most CAP are still open
        still_open = [s for s in silent + trickling if _closed_within(s, 0.05) is None]
        assert len(still_open) <= CAP
    finally:
        for sock in silent + trickling:
            sock.close()
    assert "connection cap reached" in srv.log()


def test_a_silent_connection_is_closed_after_the_header_timeout(
    guarded_server: ServerProcess,
) -> None:
    with contextlib.closing(_connect(guarded_server)) as sock:
        assert _closed_within(sock, HEADER_S + 3.0) == b""


def test_trickled_headers_do_not_extend_the_header_timeout(guarded_server: ServerProcess) -> None:
    with contextlib.closing(_connect(guarded_server)) as sock:
        start = time.monotonic()
        request = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
        sock.settimeout(0.2)
        closed = False
        for byte in request:  # one byte every 0.1 s: slower than any timeout would allow
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            with contextlib.suppress(TimeoutError):
                if sock.recv(1) == b"":
                    closed = True
                    break
            if time.monotonic() - start > HEADER_S + 5.0:
                break
        assert closed, "a trickling client kept its connection past the header timeout"
        assert time.monotonic() - start < HEADER_S + 5.0


def test_a_slow_body_gets_408(guarded_server: ServerProcess) -> None:
    with contextlib.closing(_connect(guarded_server)) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n" + b'{"model": "'
        )
        answer = _closed_within(sock, BODY_S + 3.0)
    assert answer is not None, "a body that stopped arriving was waited for forever"
    assert answer.startswith(b"HTTP/1.1 408")
    assert b'"code": "request_timeout"' in answer


def test_keep_alive_connections_are_reused_within_the_limits(
    guarded_server: ServerProcess,
) -> None:
    with contextlib.closing(_connect(guarded_server)) as sock:
        sock.settimeout(5)
        for _ in range(3):  # one after the other on the same connection
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            response = b""
            while not response.endswith(b"}"):
                response += sock.recv(65536)
            assert response.startswith(b"HTTP/1.1 200")


# --- the guard's bookkeeping, with fake protocols ---------------------------------------------


class _FakeTransport:
    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def _protocol(cycle: object | None = None) -> SimpleNamespace:
    return SimpleNamespace(transport=_FakeTransport(), cycle=cycle)


def _serving() -> SimpleNamespace:
    return SimpleNamespace(response_complete=False, more_body=False)


def test_guard_evicts_the_oldest_idle_connection_then_refuses_when_all_are_served() -> None:
    async def scenario() -> None:
        guard = ConnectionGuard(max_connections=2, timeout_header_s=None, timeout_body_s=None)
        first, second = _protocol(), _protocol()
        guard.opened(first)
        guard.opened(second)
        second.cycle = _serving()
        guard.progressed(second)
        third = _protocol()
        guard.opened(third)  # over the cap: the oldest idle one (first) goes
        assert first.transport.closed and not second.transport.closed
        guard.closed(first)
        third.cycle = _serving()
        guard.progressed(third)
        fourth = _protocol()
        guard.opened(fourth)  # both others are being served: the newcomer is refused
        assert fourth.transport.written.startswith(b"HTTP/1.1 503")
        assert b"retry-after: 1" in fourth.transport.written
        assert not second.transport.closed and not third.transport.closed
        assert (guard.evicted, guard.refused) == (1, 1)

    asyncio.run(scenario())


def test_guard_prefers_waiting_over_receiving_victims() -> None:
    async def scenario() -> None:
        guard = ConnectionGuard(max_connections=2, timeout_header_s=None, timeout_body_s=None)
        receiving = _protocol(SimpleNamespace(response_complete=False, more_body=True))
        waiting = _protocol()
        guard.opened(receiving)
        guard.progressed(receiving)
        guard.opened(waiting)
        guard.opened(_protocol())
        assert waiting.transport.closed and not receiving.transport.closed
        assert guard._conns[id(receiving)].state is ConnState.RECEIVING

    asyncio.run(scenario())
