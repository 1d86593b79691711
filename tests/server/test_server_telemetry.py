"""The frontend's telemetry wiring seen from outside: a trace per request, /metrics."""

from __future__ import annotations

import json
import secrets
import time

from prometheus_client.parser import text_string_to_metric_families
from server_harness import MODEL, ServerProcess


def spans_of(path, trace_id: str) -> list[dict]:
    spans = []
    if path.exists():
        for line in path.read_text().splitlines():
            for rs in json.loads(line).get("resourceSpans", ()):
                for ss in rs.get("scopeSpans", ()):
                    spans += [s for s in ss.get("spans", ()) if s["traceId"] == trace_id]
    return spans


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
