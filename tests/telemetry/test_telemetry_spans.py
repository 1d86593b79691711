"""Span helpers and the request recorder, against the SDK's in-memory exporter: failure isolation,
context carrying, request edge cases (abort in queue, single token, offline), timing headers."""

from __future__ import annotations

import time

import pytest
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from inferflow.outputs import RequestMetrics
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.plan import ExecutorOutput, SampledToken, ScheduledChunk, SchedulerOutput
from inferflow.telemetry import (
    EngineTelemetry,
    RequestTimings,
    RequestTrace,
    TracingConfig,
    extract_context,
    get_tracer,
    setup_tracing,
    stage_span,
    start_request_span,
    timing_headers,
    traceparent_of,
)
from inferflow.telemetry.spans import parent_context
from inferflow.telemetry.trace_model import SpanRecord, spans_from_request

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def mem() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def records(exporter: InMemorySpanExporter) -> dict[str, SpanRecord]:
    spans = spans_from_request(encode_spans(exporter.get_finished_spans()))
    return {s.name: s for s in spans}


class BrokenTracer:
    """A tracer whose every call fails, to prove telemetry errors never reach the request."""

    def start_span(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("exporter on fire")


def test_stage_span_records_and_reraises_body_errors(mem) -> None:
    provider, exporter = mem
    with (
        pytest.raises(KeyError, match="bad"),
        stage_span(get_tracer(provider), "tokenizer", parent=TP),
    ):
        raise KeyError("bad")
    span = records(exporter)["tokenizer"]
    assert span.status_code == 2 and span.attributes["error.type"] == "KeyError"
    assert (
        span.trace_id == "0af7651916cd43dd8448eb211c80319c"
        and span.parent_span_id == "b7ad6b7169203331"
    )


def test_telemetry_failures_never_break_the_request() -> None:
    broken = BrokenTracer()
    with stage_span(broken, "validator", parent=TP) as span:  # type: ignore[arg-type]
        result = 6 * 7
    assert result == 42 and not span.is_recording()
    root = start_request_span(broken, operation="chat", model="m", headers={"traceparent": TP})  # type: ignore[arg-type]
    root.set_response(finish_reasons=["stop"], input_tokens=1, output_tokens=1)
    root.set_timings(RequestTimings(arrival_time=1.0, finished_time=2.0))
    root.end()
    assert root.traceparent is None
    telemetry = EngineTelemetry(broken)  # type: ignore[arg-type]
    telemetry.on_request_arrived("r", num_prompt_tokens=3)
    with telemetry.stage("r", "detokenizer"):
        pass
    assert telemetry.on_request_finished("r", "stop") is not None  # timings survive, spans do not


def test_extract_context_and_traceparent_round_trip(mem) -> None:
    provider, exporter = mem
    tracer = get_tracer(provider)
    assert not extract_context({"traceparent": "00-garbage"}).values()  # malformed: new trace
    root = start_request_span(tracer, operation="chat", model="m", headers=[("TraceParent", TP)])
    assert root.traceparent is not None and root.traceparent.startswith(
        "00-0af7651916cd43dd8448eb211c80319c-"
    )
    child_ctx = parent_context(root.traceparent)
    assert traceparent_of(child_ctx) == root.traceparent
    root.end()
    root.end()  # idempotent
    span = records(exporter)["chat m"]
    assert span.kind == 2  # OTLP SPAN_KIND_SERVER
    assert span.parent_span_id == "b7ad6b7169203331"


def test_request_aborted_in_queue_has_no_compute(mem) -> None:
    provider, exporter = mem
    rt = RequestTrace(get_tracer(provider), "r", parent=TP, arrival_time=100.0, num_prompt_tokens=4)
    timings = rt.finish("abort", 100.5)
    spans = records(exporter)
    assert set(spans) == {"llm_request", "queue"}
    assert spans["queue"].duration_s == pytest.approx(0.5) and timings.queue_time == pytest.approx(
        0.5
    )
    assert timings.inference_time is None and timings.time_to_first_token is None
    assert spans["llm_request"].attributes["gen_ai.response.finish_reasons"] == ["abort"]
    assert rt.finish("stop", 200.0).finished_time == 100.5  # second finish: no change, no spans
    assert len(exporter.get_finished_spans()) == 2


def test_single_token_request_is_prefill_only_and_offline_root(mem) -> None:
    provider, exporter = mem
    rt = RequestTrace(get_tracer(provider), "r", arrival_time=10.0, num_prompt_tokens=4)  # offline
    rt.mark_scheduled(10.1)
    rt.mark_step(prefill=True)
    assert rt.mark_token(10.3) is None  # first token: no inter-token gap
    for t in (10.31, 10.32, 10.33):  # incremental detokenizer runs coalesce into one span
        rt.record_stage("detokenizer", t, t + 0.002)
    rt.finish("length", 10.34)
    spans = records(exporter)
    assert "decode" not in spans and spans["prefill"].duration_s == pytest.approx(0.2)
    assert spans["llm_request"].parent_span_id == ""  # no API process: llm_request is the root
    detok = spans["detokenizer"]
    assert detok.parent_span_id == spans["llm_request"].span_id
    assert detok.attributes["inferflow.stage.calls"] == 3
    assert detok.attributes["inferflow.stage.busy_time"] == pytest.approx(0.006)
    assert detok.duration_s == pytest.approx(0.022)


def test_update_from_request_metrics(mem) -> None:
    provider, exporter = mem
    rt = RequestTrace(get_tracer(provider), "r", arrival_time=0.0)
    metrics = RequestMetrics(
        arrival_time=5.0,
        first_scheduled_time=5.5,
        first_token_time=6.0,
        last_token_time=7.0,
        num_cached_prompt_tokens=16,
    )
    rt.update_from_metrics(metrics)
    rt.num_output_tokens = 3
    t = rt.finish("stop", 7.0)
    assert (t.queue_time, t.prefill_time, t.decode_time) == pytest.approx((0.5, 0.5, 1.0))
    assert t.time_per_output_token == pytest.approx(0.5)
    assert records(exporter)["prefill"].attributes["gen_ai.usage.cache_read.input_tokens"] == 16


def test_timing_headers_and_round_trip() -> None:
    t = RequestTimings(
        arrival_time=1.0,
        first_scheduled_time=1.002,
        first_token_time=1.012,
        prefill_end_time=1.012,
        last_token_time=1.042,
        finished_time=1.0425,
        num_output_tokens=4,
    )
    h = timing_headers(t)
    assert float(h["x-inferflow-queue-time-ms"]) == pytest.approx(2.0)
    assert float(h["x-inferflow-inference-time-ms"]) == pytest.approx(40.5)
    assert float(h["x-inferflow-time-to-first-token-ms"]) == pytest.approx(12.0)
    parts = dict(p.split(";dur=") for p in h["server-timing"].split(", "))
    assert list(parts) == ["queue", "prefill", "decode", "inference", "e2e"]
    assert float(parts["decode"]) == pytest.approx(30.5) and float(parts["e2e"]) == pytest.approx(
        42.5
    )
    assert t.time_per_output_token == pytest.approx(0.010)
    queued = timing_headers(RequestTimings(arrival_time=1.0, finished_time=1.5))
    assert set(queued) == {"x-inferflow-queue-time-ms", "server-timing"}


def test_tracing_off_records_nothing_but_keeps_timings(tmp_path) -> None:
    provider = setup_tracing(TracingConfig(exporter="off", file_path=str(tmp_path / "t.jsonl")))
    tracer = get_tracer(provider)
    root = start_request_span(tracer, operation="chat", model="m", headers={"traceparent": TP})
    assert not root.is_recording
    telemetry = EngineTelemetry(tracer)
    telemetry.on_request_arrived(
        "r", num_prompt_tokens=2, trace_context=root.trace_context, arrival_time=1.0
    )
    chunk = ScheduledChunk("r", 0, (1, 2), 0, True, SamplingParams())
    telemetry.on_step(
        SchedulerOutput((chunk,)),
        ExecutorOutput({"r": SampledToken(3)}),
        start_time=1.5,
        end_time=2.0,
    )
    timings = telemetry.on_request_finished("r", "stop", finish_time=2.0)
    assert timings is not None and timings.queue_time == pytest.approx(0.5)
    provider.shutdown()
    assert not (tmp_path / "t.jsonl").exists()


def test_live_spans_use_wall_clock(mem) -> None:
    provider, exporter = mem
    before = time.time_ns()
    with stage_span(get_tracer(provider), "cache"):
        pass
    span = records(exporter)["cache"]
    assert before <= span.start_ns <= span.end_ns <= time.time_ns()
