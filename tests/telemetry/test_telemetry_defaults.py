"""Tracing defaults that do not surprise: the trace file rotates, a missing collector neither
floods the log nor holds up shutdown, and the viewer filters one model out of a shared file."""

from __future__ import annotations

import io
import json
import logging
import socket
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from inferflow.telemetry import TracingConfig, get_tracer, setup_tracing, shutdown_tracing
from inferflow.telemetry.export_log import ExportFailureLog
from inferflow.telemetry.otlp_json import OtlpJsonFileSpanExporter
from inferflow.telemetry.trace_viewer import main as viewer


def _spans_through(exporter: OtlpJsonFileSpanExporter, count: int, resource: dict | None = None):
    from opentelemetry.sdk.resources import Resource

    provider = TracerProvider(resource=Resource.create(resource or {}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for i in range(count):
        with tracer.start_as_current_span(f"span-{i}"):
            pass
    return provider


def test_the_trace_file_rotates_by_size_across_writers(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    # two writers on one path, like a server's API process and engine worker
    first = OtlpJsonFileSpanExporter(path, max_bytes=4096, backups=2)
    second = OtlpJsonFileSpanExporter(path, max_bytes=4096, backups=2)
    for _ in range(6):
        _spans_through(first, 10)
        _spans_through(second, 10)
    files = sorted(p.name for p in tmp_path.glob("traces.jsonl*") if not p.name.endswith(".lock"))
    assert files == ["traces.jsonl", "traces.jsonl.1", "traces.jsonl.2"]  # 2 backups kept
    for name in files:  # every line whole, no file far past the limit
        text = (tmp_path / name).read_text()
        assert all(json.loads(line) for line in text.splitlines())
        assert len(text) < 4096 + 2048
    assert TracingConfig().max_file_mb == 64.0 and TracingConfig().backup_count == 3


def test_export_failures_are_logged_once_then_summarised() -> None:
    flt = ExportFailureLog("http://collector:4317", interval_s=3600)

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("otel", logging.ERROR, __file__, 1, msg, (), None)

    first = record("Failed to export traces")
    assert flt.filter(first) and "further failures are summarised" in first.getMessage()
    assert not any(flt.filter(record("Failed to export traces")) for _ in range(5))
    assert not flt.filter(record("Exporter already shutdown, ignoring batch"))
    flt._window_start -= 3600  # an hour later
    summary = record("Failed to export traces")
    assert flt.filter(summary)
    assert summary.getMessage().startswith("trace export to http://collector:4317: 6 more")


def test_shutdown_with_no_collector_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    provider = setup_tracing(TracingConfig(exporter="otlp", endpoint=f"http://127.0.0.1:{port}"))
    tracer = get_tracer(provider)
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            with tracer.start_as_current_span("x"):
                pass
        started = time.monotonic()
        shutdown_tracing(provider)
        took = time.monotonic() - started
    assert took < 4.0  # export_timeout_s is 10 s: the flush gives up after ~1.5 s
    failures = [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert len(failures) <= 1, [r.getMessage() for r in failures]


def test_the_viewer_filters_one_model(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    exporter = OtlpJsonFileSpanExporter(path)
    for model in ("tiny-llama", "other-model"):
        provider = _spans_through(exporter, 0, {"inferflow.model.name": model})
        tracer = provider.get_tracer("t")
        with tracer.start_as_current_span(f"text_completion {model}") as root:
            root.set_attribute("gen_ai.operation.name", "text_completion")
            root.set_attribute("gen_ai.request.model", model)
            with tracer.start_as_current_span("llm_request"):
                pass
    out = io.StringIO()
    assert viewer([str(path), "--model", "other-model", "--limit", "0"], out=out) == 0
    text = out.getvalue()
    assert "other-model" in text and "text_completion tiny-llama" not in text
