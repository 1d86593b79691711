"""inferflow observability: OpenTelemetry tracing (queue vs compute, per stage), Prometheus
metrics across LitServe's processes, and a trace viewer. See docs/observability.md.

API process (frontend)::

    provider = setup_tracing(TracingConfig.from_mapping(cfg), resource_attributes(...))
    tracer = get_tracer(provider)
    root = start_request_span(tracer, operation="chat", model=name, headers=request.headers, ...)
    submit.trace_context = root.trace_context          # W3C carrier, carried to the worker
    pipeline = RequestPipeline(..., wrap_stage=make_stage_wrapper(tracer, parent_of))
    ...
    root.set_response(...); root.set_timings(timings); root.end()
    response.headers.update(timing_headers(timings))

Worker process (engine)::

    telemetry = EngineTelemetry(get_tracer(setup_tracing(...)), EngineMetrics(name, worker_id))
    executor = TracedExecutor(executor, telemetry, snapshot=lambda: scheduler.stats)
    telemetry.on_request_arrived(...); telemetry.on_request_finished(...)
"""

from inferflow.telemetry.engine_telemetry import EngineTelemetry, SchedulerSnapshot
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
    make_stage_wrapper,
    record_step_span,
    stage_span,
    start_request_span,
    traceparent_of,
)
from inferflow.telemetry.timings import RequestTimings, phase_timing_headers, timing_headers
from inferflow.telemetry.traced_executor import TracedExecutor

__all__ = [
    "EngineMetrics",
    "EngineTelemetry",
    "FinishedRequestStats",
    "RequestSpan",
    "RequestTimings",
    "RequestTrace",
    "SchedulerSnapshot",
    "ServerMetrics",
    "StepStats",
    "TracedExecutor",
    "TracingConfig",
    "TracingConfigError",
    "cleanup_multiprocess_dir",
    "emit_span",
    "extract_context",
    "flush_tracing",
    "get_tracer",
    "make_stage_wrapper",
    "mark_process_dead",
    "phase_timing_headers",
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
