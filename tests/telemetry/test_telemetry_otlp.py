"""Traces exported over real OTLP (gRPC and HTTP receivers in this process, protobuf decoded):
span tree per request, traceparent continuation (also across a real process boundary), queue vs
compute spans, engine-step links, GenAI attributes, exporter headers and resource attributes."""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
from otlp_receiver import GrpcOtlpReceiver, HttpOtlpReceiver
from telemetry_scenarios import (
    CLIENT_SPAN_ID,
    CLIENT_TRACE_ID,
    EXPECTED,
    PROMPT_LEN,
    api_finish,
    api_start,
    otlp_config,
    worker_process_main,
    worker_side,
)

from inferflow.telemetry import (
    EngineMetrics,
    EngineTelemetry,
    flush_tracing,
    get_tracer,
    resource_attributes,
    setup_tracing,
    shutdown_tracing,
)
from inferflow.telemetry.trace_model import (
    SPAN_KIND_SERVER,
    SpanRecord,
    children_index,
    group_by_trace,
)

TOL = 2e-6  # float seconds -> ns round-off


@pytest.fixture(params=["grpc", "http"])
def receiver(request: pytest.FixtureRequest):
    cls = GrpcOtlpReceiver if request.param == "grpc" else HttpOtlpReceiver
    with cls() as rx:
        yield request.param, rx


def _resource() -> dict:
    return resource_attributes(
        model_name="tiny-llama",
        model_version="sha256:abc",
        engine="onnxruntime",
        engine_version="1.32.0",
    )


def _request_traces(spans: list[SpanRecord]) -> dict[str, list[SpanRecord]]:
    """request id -> its trace's spans (the trace holding that request's llm_request span)."""
    by_trace = group_by_trace(spans)
    return {
        s.attributes["inferflow.request.id"]: by_trace[s.trace_id]
        for s in spans
        if s.name == "llm_request"
    }


def _tree(
    trace_spans: list[SpanRecord],
) -> tuple[SpanRecord, dict[str, list[str]], dict[str, SpanRecord]]:
    """(root, parent name -> sorted child names, name -> span) of one request trace."""
    by_name = {s.name: s for s in trace_spans}
    index = children_index(trace_spans)
    roots = [s for s in trace_spans if s.kind == SPAN_KIND_SERVER]
    assert len(roots) == 1
    tree = {s.name: sorted(c.name for c in index.get(s.span_id, ())) for s in trace_spans}
    return roots[0], tree, by_name


def _check_request(rid: str, trace_spans: list[SpanRecord]) -> None:
    root, tree, span = _tree(trace_spans)
    assert root.name == "chat tiny-llama"
    assert tree[root.name] == ["detokenizer", "llm_request", "tokenizer", "validator"]
    assert tree["llm_request"] == ["compute", "queue"]  # queue and compute: separate spans
    assert tree["compute"] == ["decode", "prefill"]
    exp = EXPECTED[rid]
    for name, key in (("queue", "queue"), ("prefill", "prefill"), ("decode", "decode")):
        assert span[name].duration_s == pytest.approx(exp[key], abs=TOL), name
    llm, queue, compute = span["llm_request"], span["queue"], span["compute"]
    # queue ends where compute starts; together they are the engine's e2e
    assert queue.end_ns == compute.start_ns
    assert queue.duration_s + compute.duration_s == pytest.approx(llm.duration_s, abs=TOL)
    assert llm.duration_s == pytest.approx(exp["e2e"], abs=TOL)
    assert span["prefill"].duration_s + span["decode"].duration_s == pytest.approx(
        compute.duration_s, abs=TOL
    )
    assert root.start_ns <= llm.start_ns and llm.end_ns <= root.end_ns
    for attrs in (llm.attributes, root.attributes):  # vLLM-style latencies, engine- and root-side
        assert attrs["gen_ai.latency.time_in_queue"] == pytest.approx(exp["queue"], abs=TOL)
        assert attrs["gen_ai.latency.time_to_first_token"] == pytest.approx(exp["ttft"], abs=TOL)
        assert attrs["gen_ai.latency.time_in_model_prefill"] == pytest.approx(
            exp["prefill"], abs=TOL
        )
        assert attrs["gen_ai.latency.time_in_model_decode"] == pytest.approx(exp["decode"], abs=TOL)
        assert attrs["gen_ai.latency.e2e"] == pytest.approx(exp["e2e"], abs=TOL)
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny-llama"
    assert a["gen_ai.request.max_tokens"] > 0 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.response.finish_reasons"] == [{"r1": "length", "r2": "stop"}[rid]]
    assert (
        a["gen_ai.usage.input_tokens"] == PROMPT_LEN[rid] and a["gen_ai.usage.output_tokens"] == 3
    )
    assert a["gen_ai.usage.cache_read.input_tokens"] == (2 if rid == "r2" else 0)
    assert llm.attributes["gen_ai.usage.cache_read.input_tokens"] == (2 if rid == "r2" else 0)
    assert span["detokenizer"].attributes["inferflow.stage.calls"] == 1


def _check_steps(spans: list[SpanRecord], traces: dict[str, list[SpanRecord]]) -> None:
    llm_ids = {
        rid: next(s.span_id for s in t if s.name == "llm_request") for rid, t in traces.items()
    }
    steps = sorted(
        (s for s in spans if s.name == "engine step"),
        key=lambda s: s.attributes["inferflow.step.id"],
    )
    assert len(steps) == 4
    request_trace_ids = {t[0].trace_id for t in traces.values()}
    assert all(s.trace_id not in request_trace_ids and not s.parent_span_id for s in steps)
    linked = [sorted(s.attributes["inferflow.step.request_ids"]) for s in steps]
    assert linked == [["r1"], ["r1", "r2"], ["r1", "r2"], ["r2"]]
    for step in steps:  # link i points at the llm_request span of request_ids[i]
        assert len(step.links) == len(step.attributes["inferflow.step.request_ids"])
        for link, rid in zip(
            step.links, step.attributes["inferflow.step.request_ids"], strict=True
        ):
            assert (link.trace_id, link.span_id) == (traces[rid][0].trace_id, llm_ids[rid])
    step1 = steps[1].attributes
    assert step1["inferflow.step.batch_size"] == 2
    assert (
        step1["inferflow.step.num_prefill_tokens"] == 7
        and step1["inferflow.step.num_decode_tokens"] == 1
    )


def test_span_tree_over_otlp(receiver: tuple[str, GrpcOtlpReceiver | HttpOtlpReceiver]) -> None:
    protocol, rx = receiver
    # two providers, as the API process and the worker each have their own
    api = setup_tracing(otlp_config(protocol, rx.endpoint), _resource())
    worker = setup_tracing(otlp_config(protocol, rx.endpoint, "inferflow-worker"), _resource())
    try:
        base = time.time()
        roots = {rid: api_start(get_tracer(api), rid, base, rid == "r1") for rid in ("r1", "r2")}
        telemetry = EngineTelemetry(get_tracer(worker), EngineMetrics("tiny-llama"))
        timings = worker_side(telemetry, {rid: r.trace_context for rid, r in roots.items()}, base)
        for rid, root in roots.items():
            api_finish(root, rid, timings[rid], base)
        assert flush_tracing(worker) and flush_tracing(api)
    finally:
        shutdown_tracing(api)
        shutdown_tracing(worker)
    spans = rx.spans()
    traces = _request_traces(spans)
    assert set(traces) == {"r1", "r2"}
    for rid, trace_spans in traces.items():
        _check_request(rid, trace_spans)
    # r1 continued the client's traceparent: same trace id, parent = the client's span
    r1_root = next(s for s in traces["r1"] if s.kind == SPAN_KIND_SERVER)
    assert r1_root.trace_id == f"{CLIENT_TRACE_ID:032x}"
    assert r1_root.parent_span_id == f"{CLIENT_SPAN_ID:016x}"
    r2_root = next(s for s in traces["r2"] if s.kind == SPAN_KIND_SERVER)
    assert r2_root.trace_id != r1_root.trace_id and r2_root.parent_span_id == ""
    _check_steps(spans, traces)
    assert all(h.get("x-api-key") == "secret-key" for h in rx.headers)
    res = r1_root.resource
    assert res["service.name"] == "inferflow" and res["inferflow.model.name"] == "tiny-llama"
    assert (
        res["inferflow.model.version"] == "sha256:abc"
        and res["inferflow.engine.name"] == "onnxruntime"
    )
    assert res["inferflow.engine.version"] == "1.32.0" and "process.runtime.version" in res
    assert "service.version" in res


def test_traceparent_carried_to_a_worker_process() -> None:
    """The worker side runs in a spawned process (as LitServe's inference worker) with its own
    provider; only W3C carrier dicts and timing dicts cross the boundary."""
    with GrpcOtlpReceiver() as rx:
        api = setup_tracing(otlp_config("grpc", rx.endpoint), _resource())
        try:
            base = time.time()
            roots = {
                rid: api_start(get_tracer(api), rid, base, rid == "r1") for rid in ("r1", "r2")
            }
            tps = {rid: r.trace_context for rid, r in roots.items()}
            ctx = multiprocessing.get_context("spawn")
            with ProcessPoolExecutor(1, mp_context=ctx) as pool:
                timings = pool.submit(worker_process_main, "grpc", rx.endpoint, tps, base).result(
                    timeout=120
                )
            for rid, root in roots.items():
                api_finish(root, rid, timings[rid], base)
            assert flush_tracing(api)
        finally:
            shutdown_tracing(api)
        spans = rx.spans()
    traces = _request_traces(spans)
    for rid, trace_spans in traces.items():
        _check_request(rid, trace_spans)
        services = {s.name: s.service_name for s in trace_spans}
        assert (
            services["chat tiny-llama"] == "inferflow" and services["queue"] == "inferflow-worker"
        )
    _check_steps(spans, traces)


def test_sampling_follows_incoming_parent_and_ratio() -> None:
    """sample_ratio=0 drops new traces, but a sampled incoming traceparent is honoured (ParentBased);
    an engine step serving a sampled request is kept through its link."""
    with GrpcOtlpReceiver() as rx:
        cfg = otlp_config("grpc", rx.endpoint)
        cfg.sample_ratio = 0.0
        provider = setup_tracing(cfg, _resource())
        try:
            base = time.time()
            roots = {
                rid: api_start(get_tracer(provider), rid, base, rid == "r1") for rid in ("r1", "r2")
            }
            telemetry = EngineTelemetry(get_tracer(provider))
            timings = worker_side(
                telemetry, {rid: r.trace_context for rid, r in roots.items()}, base
            )
            for rid, root in roots.items():
                api_finish(root, rid, timings[rid], base)
            assert flush_tracing(provider)
        finally:
            shutdown_tracing(provider)
        spans = rx.spans()
    assert {s.trace_id for s in spans if s.name != "engine step"} == {f"{CLIENT_TRACE_ID:032x}"}
    steps = [s for s in spans if s.name == "engine step"]
    # steps 0-2 served r1 (sampled); step 3 served only r2 (dropped at ratio 0)
    assert sorted(s.attributes["inferflow.step.id"] for s in steps) == [0, 1, 2]
