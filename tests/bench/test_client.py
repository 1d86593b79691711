"""Request bodies and headers the generator sends."""

from __future__ import annotations

import re

from inferflow.bench.client import EndpointSpec, build_headers, build_payload, make_traceparent
from inferflow.bench.records import SampleRequest

SAMPLE = SampleRequest("hello world", 2, 7)


def test_completions_payload_streams_with_usage_and_output_length() -> None:
    body = build_payload(EndpointSpec("http://x/v1/completions", "m"), SAMPLE)
    assert body == {
        "model": "m",
        "stream": True,
        "prompt": "hello world",
        "max_tokens": 7,
        "stream_options": {"include_usage": True},
    }


def test_chat_payload_ignore_eos_forced_length_and_extra_body() -> None:
    spec = EndpointSpec(
        "http://x/v1/chat/completions",
        "m",
        chat=True,
        ignore_eos=True,
        force_output_len=True,
        include_usage=False,
        extra_body={"temperature": 0},
    )
    body = build_payload(spec, SampleRequest("q", 1, 5, messages=(("system", "s"), ("user", "q"))))
    assert body["messages"] == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q"},
    ]
    assert body["max_tokens"] == body["max_completion_tokens"] == body["min_tokens"] == 5
    assert body["ignore_eos"] is True and body["temperature"] == 0
    assert "stream_options" not in body and "prompt" not in body


def test_headers_carry_request_id_and_traceparent(monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    spec = EndpointSpec("u", "m", extra_headers={"x-team": "bench", "x-request-id": "ignored"})
    headers = build_headers(spec, "bench-3", "00-" + "a" * 32 + "-" + "b" * 16 + "-01")
    assert headers["x-request-id"] == "bench-3"  # the generator's id wins over --header
    assert headers["traceparent"].startswith("00-aaaa")
    assert headers["Authorization"] == "Bearer sk-test" and headers["x-team"] == "bench"


def test_traceparents_are_valid_and_unique() -> None:
    values = {make_traceparent() for _ in range(200)}
    assert len(values) == 200
    assert all(re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", v) for v in values)
    assert len({v.split("-")[1] for v in values}) == 200  # a fresh trace id per request
