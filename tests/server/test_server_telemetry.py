"""The frontend's telemetry wiring seen from outside: a trace per request, /metrics."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL, ServerProcess, start_server, trace_spans

pytestmark = [pytest.mark.server, pytest.mark.slow]


def spans_of(path, trace_id: str) -> list[dict]:
    return [s for s in trace_spans(path) if s["traceId"] == trace_id]


def test_request_trace_continues_traceparent_with_stage_and_engine_spans(
    server: ServerProcess,
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    response = server.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01"},
    )
    assert response.status_code == 200
    wanted = {
        "text_completion tiny-llama",
        "validator",
        "tokenizer",
        "llm_request",
        "queue",
        "compute",
        "detokenizer",
    }
    deadline = time.monotonic() + 30  # spans are exported in batches (a few seconds apart)
    while True:
        spans = spans_of(server.traces_path, trace_id)
        if wanted <= {s["name"] for s in spans}:
            break
        assert time.monotonic() < deadline, sorted({s["name"] for s in spans})
        time.sleep(0.2)
    by_name = {s["name"]: s for s in spans}
    root = by_name["text_completion tiny-llama"]
    assert root["parentSpanId"] == parent_id  # the client's span is the parent
    assert by_name["tokenizer"]["parentSpanId"] == root["spanId"]
    assert by_name["llm_request"]["parentSpanId"] == root["spanId"]
    assert by_name["queue"]["parentSpanId"] == by_name["llm_request"]["spanId"]
    assert by_name["detokenizer"]["parentSpanId"] == root["spanId"]  # an engine-side stage
    detok_calls = next(
        a["value"]["intValue"]
        for a in by_name["detokenizer"]["attributes"]
        if a["key"] == "inferflow.stage.calls"
    )
    assert int(detok_calls) == 4  # one run per generated token


def metric_value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def test_metrics_endpoint_merges_api_and_engine_metrics(server: ServerProcess) -> None:
    before = server.get("/metrics").text
    server.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)
    server.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    after = server.get("/metrics").text
    route = "/v1/completions"
    ok = "inferflow:http_requests_total"
    assert (
        metric_value(after, ok, route=route, status_code="200")
        == metric_value(before, ok, route=route, status_code="200") + 1
    )
    assert metric_value(after, ok, route=route, status_code="404") >= 1
    assert (
        metric_value(after, "vllm:generation_tokens_total")
        >= metric_value(before, "vllm:generation_tokens_total") + 3
    )
    assert "vllm:num_requests_running" in after


SLEEPY = Path(__file__).resolve().parent / "sleepy_plugin"


@pytest.fixture(scope="module")
def sleepy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A plugin request stage that sleeps 200 ms, traced to a file."""
    traces = tmp_path_factory.mktemp("sleepy_traces") / "traces.jsonl"
    env = {
        "INFERFLOW_CONFIG_PATH": str(SLEEPY / "conf"),
        "INFERFLOW_ALLOWED_TARGETS": "sleepy_stage",
        "PYTHONPATH": str(SLEEPY),  # added in front of the current path
    }
    srv = start_server(
        tmp_path_factory,
        "sleepy",
        ["+stages=sleepy", "tracing=file", f"tracing.file_path={traces}"],
        env,
    )
    srv.traces_path = traces  # type: ignore[attr-defined]
    yield srv
    srv.terminate()


def _duration_s(span: dict) -> float:
    return (int(span["endTimeUnixNano"]) - int(span["startTimeUnixNano"])) / 1e9


def test_request_stage_time_is_the_stage_span_not_queue_time(sleepy_server: ServerProcess) -> None:
    trace_id = secrets.token_hex(16)
    response = sleepy_server.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0},
        headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01"},
    )
    assert response.status_code == 200
    queue_ms = float(response.headers["x-inferflow-queue-time-ms"])
    deadline = time.monotonic() + 30
    while True:
        spans = {s["name"]: s for s in spans_of(sleepy_server.traces_path, trace_id)}
        if {"sleepy", "queue", "llm_request"} <= set(spans):
            break
        assert time.monotonic() < deadline, sorted(spans)
        time.sleep(0.2)
    assert _duration_s(spans["sleepy"]) >= 0.2  # the stage's own span holds its 200 ms
    assert _duration_s(spans["queue"]) < 0.1 and queue_ms < 100  # idle server: hardly any queue
    submit = next(
        a["value"]["doubleValue"]
        for a in spans["llm_request"]["attributes"]
        if a["key"] == "inferflow.request.submit_delay"
    )
    assert 0 <= submit < 0.2  # the hop to the worker, kept apart
    text = sleepy_server.get("/metrics").text
    queued = metric_value(text, "vllm:request_queue_time_seconds_sum")
    assert queued < 0.1, queued
