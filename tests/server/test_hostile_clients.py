"""Hostile clients on the default server: odd keys at any depth of any POST body are a 400 that
names the field safely and keeps the keep-alive connection, and a client that hangs up in the
middle of its body leaves no traceback in the log."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from hostile_json import check_answer, client_port, has_lone_surrogate, hostile_bodies
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow]

SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}
VALID: dict[str, dict] = {
    "/v1/completions": {
        "model": MODEL, "prompt": "Hi", "max_tokens": 1, "stream": True,
        "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
    },
    "/v1/chat/completions": {
        "model": MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}],
    },
    f"/admin/models/{MODEL}/traffic": {"weights": {"1": 1}},
}
CASES = st.sampled_from(sorted(VALID)).flatmap(
    lambda route: hostile_bodies(VALID[route]).map(lambda body: (route, body))
)


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    """One client, one connection: every request of the test goes over the same socket."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    with httpx.Client(base_url=server.base_url, timeout=60, limits=limits) as client:
        yield client


# the reported ones: a lone surrogate as a key below the top level
@example(case=("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "stream": true, '
                                  b'"stream_options": {"\\ud800": 1}}'))
@example(case=("/v1/chat/completions", b'{"model": "tiny-llama", "messages": '
                                       b'[{"role": "user", "content": "hi", "\\ud800": 1}]}'))
@example(case=("/v1/completions", b'{"model": "tiny-llama", "prompt": "x", "response_format": '
                                  b'{"type": "json_schema", "json_schema": {"name": "a", '
                                  b'"schema": {"\\ud800": 1}}}}'))
@example(case=(f"/admin/models/{MODEL}/traffic", b'{"weights": {"1": 1, "\\udfff": 1}}'))
@settings(max_examples=70, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=CASES)
def test_hostile_keys_at_any_depth_are_never_a_5xx_and_keep_the_connection(
    http: httpx.Client, case: tuple[str, bytes]
) -> None:
    route, body = case
    response = http.post(route, content=body, headers={"content-type": "application/json"})
    check_answer(response, body)
    if has_lone_surrogate(body):  # anywhere: refused, the key quoted escaped
        assert response.status_code == 400, response.text[:500]
    port = client_port(response)
    following = http.post(route, json=VALID[route])
    assert following.status_code == 200, following.text[:500]
    assert client_port(following) == port, "the server closed the keep-alive connection"


def _counted(server: ServerProcess, status: str) -> float:
    families = text_string_to_metric_families(server.get("/metrics").text)
    return sum(
        s.value for f in families if f.name == "inferflow:http_requests" for s in f.samples
        if s.name.endswith("_total") and s.labels["route"] == "/v1/completions"
        and s.labels["status_code"] == status
    )


def test_a_client_that_hangs_up_mid_body_leaves_no_traceback(server: ServerProcess) -> None:
    before, log_start = _counted(server, "499"), len(server.log())
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(head + b'{"model": "tiny-llama", "prom')
    deadline = time.monotonic() + 30
    while _counted(server, "499") < before + 1:  # the server saw the hang-up and counted it
        assert time.monotonic() < deadline, "the hang-up was not counted as a 499"
        time.sleep(0.05)
    assert server.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
                       ).status_code == 200
    tail = server.log()[log_start:]
    assert "Traceback" not in tail and "ClientDisconnect" not in tail, tail[-3000:]
