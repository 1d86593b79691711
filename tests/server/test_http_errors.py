"""Every error the frontend returns, with OpenAI's exact error shape."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_harness import MODEL, ServerProcess, start_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

ERROR_KEYS = {"message", "type", "param", "code"}


def error_of(response: httpx.Response, status: int) -> dict:
    """The ``error`` object of an OpenAI-shaped error response with ``status``."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == ERROR_KEYS
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def completion(server: ServerProcess, key: str | None = None, **body: object) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return server.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", **body}, headers=headers
    )


# --- 400 / 404 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"temperature": 5}, "temperature", None),
        ({"top_p": 0}, "top_p", None),
        ({"max_tokens": -1}, "max_tokens", None),
        ({"max_tokens": 100000}, "max_tokens", None),
        ({"n": 17}, "n", None),
        ({"n": 2, "best_of": 1}, "best_of", None),
        ({"n": 5, "prompt": ["Hi"] * 13}, "n", None),  # 65 choices > max_choices_per_request
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", None),
        ({"logprobs": 50}, "logprobs", None),
        ({"prompt": "word " * 3000, "max_tokens": 8}, "prompt", "context_length_exceeded"),
        ({"prompt": [1, 2, 10**9]}, "prompt[2]", None),
        ({"stream_options": {"include_usage": True}}, "stream_options", None),
    ],
)
def test_invalid_parameter_is_400_naming_the_field(
    server: ServerProcess, body: dict, param: str, code: str | None
) -> None:
    error = error_of(completion(server, **body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code


def test_chat_schema_errors_name_the_nested_field(server: ServerProcess) -> None:
    response = server.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
    )
    assert error_of(response, 400)["param"] == "messages.0.role"
    response = server.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert error_of(response, 400)["param"] == "messages"
    response = server.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert error_of(response, 400)["param"] == "model"


def test_malformed_json_is_400(server: ServerProcess) -> None:
    response = server.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert error_of(response, 400)["param"] is None


def test_unknown_model_is_404(server: ServerProcess) -> None:
    error = error_of(completion(server, model="gpt-4o"), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x", max_tokens=1)


def test_unknown_route_has_the_error_shape(server: ServerProcess) -> None:
    error_of(server.get("/v1/nothing-here"), 404)


def test_openai_client_raises_bad_request_with_the_field(server: ServerProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt="x", temperature=-1)
    assert info.value.body["param"] == "temperature"


# --- 401 / 413 -------------------------------------------------------------------------------
def test_api_key_required_when_configured(limited_server: ServerProcess) -> None:
    error = error_of(completion(limited_server, max_tokens=1), 401)
    assert error["code"] == "invalid_api_key"
    error_of(completion(limited_server, key="wrong", max_tokens=1), 401)
    with pytest.raises(openai.AuthenticationError):
        limited_server.client(api_key="wrong").models.list()
    assert completion(limited_server, key="k-main", max_tokens=1).status_code == 200
    # keys from INFERFLOW_API_KEYS work like configured ones
    assert limited_server.client(api_key="k-timeout").models.list().data[0].id == MODEL
    assert limited_server.get("/health").status_code == 200  # probes stay open
    assert limited_server.get("/ready").status_code == 200
    key = {"Authorization": "Bearer k-main"}
    for path in ("/metrics", "/version", "/docs", "/openapi.json"):  # not for anyone who asks
        refused = limited_server.get(path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key", path
        assert limited_server.get(path, headers=key).status_code == 200, path
    # the documented alternative header (docs/server.md, api_keys)
    assert limited_server.get("/v1/models", headers={"x-api-key": "k-main"}).status_code == 200
    assert limited_server.get("/v1/models", headers={"x-api-key": "wrong"}).status_code == 401


def test_version_shows_no_filesystem_paths(server: ServerProcess) -> None:
    def strings(node: object) -> list[str]:
        if isinstance(node, dict):
            return [s for v in node.values() for s in strings(v)]
        if isinstance(node, list):
            return [s for v in node for s in strings(v)]
        return [node] if isinstance(node, str) else []

    version = server.get("/version").json()
    assert version["engine"]["backend"] == "onnxruntime"
    assert not [s for s in strings(version) if s.startswith(("/", "~"))], version


def test_payload_over_limit_is_413(limited_server: ServerProcess) -> None:
    big = {"model": MODEL, "prompt": "x" * 5000, "max_tokens": 1}
    response = limited_server.post(
        "/v1/completions", json=big, headers={"Authorization": "Bearer k-main"}
    )
    assert error_of(response, 413)["code"] == "payload_too_large"

    def chunked():  # no Content-Length: counted while the body arrives
        data = json.dumps(big).encode()
        for i in range(0, len(data), 1000):
            yield data[i : i + 1000]

    response = httpx.post(
        limited_server.url("/v1/completions"),
        content=chunked(),
        timeout=30,
        headers={"Authorization": "Bearer k-main", "content-type": "application/json"},
    )
    assert error_of(response, 413)["code"] == "payload_too_large"


# --- 429 ---------------------------------------------------------------------------------------
def test_a_request_refused_with_429_is_charged_nothing(limited_server: ServerProcess) -> None:
    """4 requests/min, 3000 tokens/min: one big request takes most of the tokens, and the
    four it leaves refused (429 tokens) give their request tokens back, so three small
    requests still fit the 4 requests/min."""
    first = completion(limited_server, key="k-refund", max_tokens=1900)
    assert first.status_code in (200, 504)  # 504: the 1.5 s request timeout
    for _ in range(4):
        error = error_of(completion(limited_server, key="k-refund", max_tokens=1900), 429)
        assert error["type"] == "tokens"
    statuses = [
        completion(limited_server, key="k-refund", max_tokens=1).status_code for _ in range(3)
    ]
    assert statuses == [200] * 3
    assert error_of(completion(limited_server, key="k-refund", max_tokens=1), 429)["type"] == (
        "requests"
    )


def test_requests_per_minute_limit_is_429_with_retry_after(limited_server: ServerProcess) -> None:
    statuses = [completion(limited_server, key="k-rpm", max_tokens=1).status_code for _ in range(4)]
    assert statuses == [200] * 4
    response = completion(limited_server, key="k-rpm", max_tokens=1)
    error = error_of(response, 429)
    assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
    assert int(response.headers["retry-after"]) >= 1
    # limits are per key: another key is unaffected
    assert completion(limited_server, key="k-main", max_tokens=1).status_code == 200
    with pytest.raises(openai.RateLimitError):
        limited_server.client(api_key="k-rpm").completions.create(
            model=MODEL, prompt="x", max_tokens=1
        )


def test_tokens_per_minute_limit_is_429(limited_server: ServerProcess) -> None:
    # limit 3000 per minute; each request reserves prompt + max_tokens
    assert completion(limited_server, key="k-tpm", max_tokens=1900).status_code in (200, 504)
    response = completion(limited_server, key="k-tpm", max_tokens=1900)
    error = error_of(response, 429)
    assert (error["type"], error["code"]) == ("tokens", "rate_limit_exceeded")
    assert int(response.headers["retry-after"]) >= 1


def test_full_waiting_queue_is_429(limited_server: ServerProcess) -> None:
    """2 slots + 1 waiting request admitted; the next one is refused until one leaves."""
    limited_server.wait_until(lambda s: s["in_flight"] == 0, what="an idle server")
    with contextlib.ExitStack() as held:
        for key in ("k-q1", "k-q2", "k-q3"):
            response = held.enter_context(
                httpx.stream(
                    "POST",
                    limited_server.url("/v1/completions"),
                    timeout=30,
                    json={
                        "model": MODEL,
                        "prompt": "Hi",
                        "max_tokens": 2000,
                        "stream": True,
                        "ignore_eos": True,
                    },
                    headers={"Authorization": f"Bearer {key}"},
                )
            )
            assert response.status_code == 200
        response = completion(limited_server, key="k-q4", max_tokens=1)
        error = error_of(response, 429)
        assert error["code"] == "queue_full"
        assert int(response.headers["retry-after"]) >= 1


# --- 504 ---------------------------------------------------------------------------------------
TIMEOUT_S = 0.4  # 2,000 tokens in 0.4 s (5,000 tok/s at batch 1) is beyond any CPU here


@pytest.fixture(scope="module")
def timeout_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose request timeout no 2,000-token completion can meet, however fast the
    machine (the limited server's 1.5 s was met by the paged CPU engine on an idle machine)."""
    srv = start_server(tmp_path_factory, "timeout", [
        f"server.request_timeout_s={TIMEOUT_S}", "batching.max_num_seqs=2", "tracing=off"])
    yield srv
    srv.terminate()


def test_request_timeout_is_504_and_frees_the_slot(timeout_server: ServerProcess) -> None:
    before = timeout_server.stats()["engine"]["timed_out_requests"]
    response = completion(timeout_server, max_tokens=2000, ignore_eos=True)
    error = error_of(response, 504)
    assert error["code"] == "timeout"
    stats = timeout_server.wait_until(
        lambda s: s["engine"]["timed_out_requests"] > before and s["engine"]["running"] == 0,
        what="the timed-out request to leave the engine",
    )
    assert stats["engine"]["free_slots"] == stats["engine"]["total_slots"]


def test_streaming_timeout_ends_with_an_error_event(timeout_server: ServerProcess) -> None:
    client = timeout_server.client()
    stream = client.completions.create(
        model=MODEL, prompt="Hi", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in stream:
            received.append(chunk)
    assert info.value.body["code"] == "timeout"
    assert info.value.body["status_code"] == 504
    assert received  # the stream had started (200) before it failed


def test_error_event_is_well_formed_sse(limited_server: ServerProcess) -> None:
    lines: list[str] = []
    with httpx.stream(
        "POST",
        limited_server.url("/v1/completions"),
        timeout=30,
        json={
            "model": MODEL,
            "prompt": "Hi",
            "max_tokens": 2000,
            "stream": True,
            "ignore_eos": True,
        },
        headers={"Authorization": "Bearer k-sse"},
    ) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))
    assert set(error) == {"error"} and set(error["error"]) >= ERROR_KEYS
    assert error["error"]["status_code"] == 504


HOSTILE_BODIES = {
    "deep nesting": b'{"model": "tiny-llama", "prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}",
    "a 10,000-digit integer": b'{"model": "tiny-llama", "prompt": "x", "max_tokens": '
    + b"9" * 10000
    + b"}",
    "a lone surrogate in prompt": b'{"model": "tiny-llama", "prompt": "hi \\ud800 there"}',
    "a lone surrogate in model": b'{"model": "tiny\\udfff", "prompt": "x"}',
    "a lone surrogate in a key": b'{"model": "tiny-llama", "prompt": "x", "\\ud800": 1}',
}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_json_is_400_and_the_connection_stays_usable(
    server: ServerProcess, route: str
) -> None:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        for what, body in HOSTILE_BODIES.items():
            conn.request("POST", route, body=body, headers={"content-type": "application/json"})
            response = conn.getresponse()
            payload = json.loads(response.read())
            assert response.status == 400, (what, payload)
            assert set(payload["error"]) >= {"message", "type", "param", "code"}, what
            assert conn.sock is not None, f"{what}: the server closed the keep-alive connection"
        if route == "/v1/completions":  # the same connection still serves a normal request
            good = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            conn.request(
                "POST", route, body=json.dumps(good), headers={"content-type": "application/json"}
            )
            assert conn.getresponse().status == 200
    finally:
        conn.close()
