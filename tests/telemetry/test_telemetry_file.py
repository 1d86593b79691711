"""The ``file`` exporter (OTLP-JSON lines), the ``console`` exporter, and ``inferflow traces``."""

from __future__ import annotations

import io
import json
import random
import re
import threading

import numpy as np
import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferflow.telemetry import (
    EngineTelemetry,
    TracingConfig,
    flush_tracing,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
    stage_span,
)
from inferflow.telemetry.otlp_json import (
    otlp_dict_to_request,
    read_otlp_json_lines,
    spans_to_otlp_dict,
)
from inferflow.telemetry.trace_model import load_spans, percentile
from inferflow.telemetry.trace_viewer import main
from inferflow.testing.simulate import SimConfig, simulate, write_demo_trace

HEX32, HEX16 = re.compile(r"^[0-9a-f]{32}$"), re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("traces") / "demo.jsonl"
    requests = write_demo_trace(path, SimConfig(num_requests=6, seed=3))
    return path, requests


def test_file_lines_are_otlp_json(demo) -> None:
    path, requests = demo
    lines = path.read_text().splitlines()
    assert lines
    n_spans = 0
    for line in lines:
        data = json.loads(line)  # one ExportTraceServiceRequest per line
        for rs in data["resourceSpans"]:
            keys = {a["key"] for a in rs["resource"]["attributes"]}
            assert {"service.name", "service.version"} <= keys
            for ss in rs["scopeSpans"]:
                assert ss["scope"]["name"] == "inferflow"
                for span in ss["spans"]:
                    n_spans += 1
                    assert HEX32.match(span["traceId"]) and HEX16.match(span["spanId"])
                    assert "parentSpanId" not in span or HEX16.match(span["parentSpanId"])
                    assert isinstance(span["kind"], int)  # enums as integers
                    assert span["startTimeUnixNano"].isdigit()  # 64-bit ints as strings
                    assert int(span["endTimeUnixNano"]) >= int(span["startTimeUnixNano"])
                    for link in span.get("links", ()):
                        assert HEX32.match(link["traceId"]) and HEX16.match(link["spanId"])
    decoded = list(read_otlp_json_lines(path))
    assert all(isinstance(r, ExportTraceServiceRequest) for r in decoded)
    spans = load_spans([path])
    assert len(spans) == n_spans
    assert sum(s.name == "llm_request" for s in spans) == len(requests) == 6
    # the decoded ids are the hex text of the file, byte for byte
    first = json.loads(lines[0])["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert any(s.trace_id == first["traceId"] and s.span_id == first["spanId"] for s in spans)


def test_concurrent_writers_append_whole_lines(tmp_path) -> None:
    """Two providers (as the API process and a worker) append to one file at the same time."""
    path = tmp_path / "shared.jsonl"
    providers = [
        setup_tracing(TracingConfig(exporter="file", file_path=str(path), service_name=f"p{i}"))
        for i in range(2)
    ]

    def emit(i: int) -> None:
        tracer = get_tracer(providers[i])
        for j in range(200):
            with stage_span(tracer, f"stage-{i}", attributes={"j": j, "pad": "x" * 200}):
                pass
            if j % 20 == 0:
                flush_tracing(providers[i])

    threads = [threading.Thread(target=emit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in providers:
        shutdown_tracing(p)
    spans = load_spans([path])  # raises on any torn line
    assert sorted(s.name for s in spans) == ["stage-0"] * 200 + ["stage-1"] * 200


def test_console_exporter_prints_json_lines(capsys) -> None:
    provider = setup_tracing(TracingConfig(exporter="console"))
    with stage_span(get_tracer(provider), "tokenizer"):
        pass
    shutdown_tracing(provider)
    out = [
        json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")
    ]
    assert [span["name"] for span in out] == ["tokenizer"]


def test_viewer_waterfall_breakdown_and_summary(demo) -> None:
    path, requests = demo
    out = io.StringIO()
    assert main([str(path), "--limit", "0", "--ascii"], out=out) == 0
    text = out.getvalue()
    assert text.count("\ntrace ") + text.startswith("trace ") == 6
    assert "summary: 6 requests" in text and "engine step batch size" in text
    for req in requests:  # each request's printed queue time is its engine queue time
        t = req.timings
        assert t is not None and t.queue_time is not None
        breakdown = text.split(f"request_id={req.request_id} ")[1].splitlines()[1]
        printed = float(re.search(r"queue ([0-9.]+) ms", breakdown).group(1))
        assert printed == pytest.approx(t.queue_time * 1e3, abs=0.0011)  # printed with 3 decimals
    header = next(line for line in text.splitlines() if line.lstrip().startswith("span"))
    bar_width = len(header.split("|")[1])
    rows = [line for line in text.splitlines() if line.count("|") == 2 and "#" in line]
    root_rows = [r for r in rows if "text_completion tiny-llama" in r]
    assert root_rows and all(
        r.split("|")[1] == "#" * bar_width for r in root_rows
    )  # root fills the bar
    summary = text[text.index("summary:") :]
    names = [
        line.split()[0]
        for line in summary.splitlines()[2:]
        if line.startswith("  ") and line.split()[0] != "engine"
    ]
    assert names[:3] == ["e2e", "text_completion", "validator"]
    assert {"queue", "compute", "prefill", "decode", "detokenizer"} <= set(names)


def test_viewer_filters_and_errors(demo, tmp_path, capsys) -> None:
    path, requests = demo
    out = io.StringIO()
    assert main([str(path), "--request-id", requests[2].request_id], out=out) == 0
    assert out.getvalue().count("request_id=") == 1 and "summary: 1 requests" in out.getvalue()
    out = io.StringIO()
    assert main([str(path), "--summary-only"], out=out) == 0
    assert "request_id=" not in out.getvalue() and "p99" in out.getvalue()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(path.read_text().splitlines()[0] + "\n{not json\n")
    assert main([str(bad)]) == 1
    assert "bad.jsonl:2" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main([str(empty)]) == 1
    assert main([str(tmp_path / "missing.jsonl")]) == 1
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        values = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_direct_json_encoder_equals_the_sdk_protobuf_encoder() -> None:
    """The file exporter encodes spans straight to OTLP/JSON; parsed back, that is exactly the
    message the SDK's protobuf encoder (used by the OTLP exporters) builds."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = get_tracer(provider)
    simulate(tracer, EngineTelemetry(tracer), SimConfig(num_requests=5, seed=1))
    carrier = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "k=v",
    }
    attrs = {"b": True, "i": -3, "f": 0.25, "s": "x", "ls": ["a", "b"], "li": [1, 2], "lf": [0.5]}
    with pytest.raises(ValueError), stage_span(tracer, "failing", parent=carrier, attributes=attrs):
        raise ValueError("boom")  # exception event + error status
    provider.shutdown()
    spans = exporter.get_finished_spans()
    assert any(s.links for s in spans) and any(s.events for s in spans)
    assert otlp_dict_to_request(spans_to_otlp_dict(spans)) == encode_spans(spans)
