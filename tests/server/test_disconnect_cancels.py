"""A client that goes away frees its engine slot and KV blocks (visible in /admin/stats)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}


def _idle(stats: dict) -> bool:
    engine = stats["engine"]
    return (
        stats["in_flight"] == 0
        and engine["running"] == 0
        and engine["waiting"] == 0
        and engine["free_slots"] == engine["total_slots"]
        and engine["kv_blocks_free"] == engine["kv_blocks_total"]
    )


def test_streaming_disconnect_frees_the_slot(server: ServerProcess) -> None:
    before = server.wait_until(_idle, what="an idle server")["engine"]["aborted_requests"]
    with httpx.stream(
        "POST", server.url("/v1/completions"), json={**LONG, "stream": True}, timeout=30
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        busy = server.stats()["engine"]
        assert busy["running"] == 1 and busy["free_slots"] == busy["total_slots"] - 1
        assert busy["kv_blocks_free"] < busy["kv_blocks_total"]
    # the connection is closed here, long before 2000 tokens
    stats = server.wait_until(_idle, what="the slot to be freed")
    assert stats["engine"]["aborted_requests"] == before + 1, stats  # aborted, not finished


def test_non_streaming_disconnect_frees_the_slot(server: ServerProcess) -> None:
    before = server.wait_until(_idle, what="an idle server")["engine"]["aborted_requests"]
    body = json.dumps(LONG).encode()
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(request + body)
        server.wait_until(lambda s: s["engine"]["running"] == 1, what="the request to run")
    stats = server.wait_until(_idle, what="the slot to be freed")
    assert stats["engine"]["aborted_requests"] == before + 1, stats  # aborted, not finished


def test_finished_requests_are_not_counted_as_aborted(server: ServerProcess) -> None:
    before = server.wait_until(_idle, what="an idle server")["engine"]
    server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    after = server.wait_until(_idle, what="an idle server")["engine"]
    assert after["aborted_requests"] == before["aborted_requests"]
    assert after["finished_requests"] == before["finished_requests"] + 1
