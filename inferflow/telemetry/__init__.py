"""inferflow observability: OpenTelemetry tracing (queue vs compute, per stage), Prometheus
metrics across LitServe's processes, and a trace viewer. See docs/observability.md.

API process (frontend)::

    provider = setup_tracing(TracingConfig.from_mapping(cfg.tracing), resource_attributes(...))
    tracer = get_tracer(provider)
    root = start_request_span(tracer, operation="chat", model=name, headers=request.headers, ...)
    payload["traceparent"] = root.traceparent            # carried to the worker
    ...
    root.set_response(...); root.set_timings(timings_dict); root.end()
    response.headers.update(timing_headers(RequestTimings.from_dict(timings_dict)))

Worker process (engine)::

    telemetry = EngineTelemetry(get_tracer(setup_tracing(...)), EngineMetrics(name, worker_id))
    with stage_span(telemetry.tracer, "tokenizer", parent=payload["traceparent"]): ...
    telemetry.on_request_arrived(...); telemetry.on_step(...); telemetry.on_request_finished(...)
"""

from inferflow.telemetry.engine_telemetry import EngineTelemetry, SchedulerStats
from inferflow.telemetry.metrics import EngineMetrics, FinishedRequestStats, StepStats
from inferflow.telemetry.metrics_export import (
    ServerMetrics,
    cleanup_multiprocess_dir,
    mark_process_dead,
    prepare_multiprocess_dir,
    render_metrics,
)
from inferflow.telemetry.request_trace import RequestTrace
from inferflow.telemetry.setup import (
    TracingConfig,
    TracingConfigError,
    flush_tracing,
    get_tracer,
    resource_attributes,
    setup_tracing,
    shutdown_tracing,
)
from inferflow.telemetry.spans import (
    RequestSpan,
    emit_span,
    extract_context,
    record_step_span,
    stage_span,
    start_request_span,
    traceparent_of,
)
from inferflow.telemetry.timings import RequestTimings, timing_headers

__all__ = [
    "EngineMetrics",
    "EngineTelemetry",
    "FinishedRequestStats",
    "RequestSpan",
    "RequestTimings",
    "RequestTrace",
    "SchedulerStats",
    "ServerMetrics",
    "StepStats",
    "TracingConfig",
    "TracingConfigError",
    "cleanup_multiprocess_dir",
    "emit_span",
    "extract_context",
    "flush_tracing",
    "get_tracer",
    "mark_process_dead",
    "prepare_multiprocess_dir",
    "record_step_span",
    "render_metrics",
    "resource_attributes",
    "setup_tracing",
    "shutdown_tracing",
    "stage_span",
    "start_request_span",
    "timing_headers",
    "traceparent_of",
]
