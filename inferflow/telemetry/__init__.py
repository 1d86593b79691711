"""inferflow observability: OpenTelemetry tracing (queue vs compute, per stage), Prometheus
metrics across LitServe's processes, and a trace viewer. See docs/observability.md. It wraps the
engine from outside (imports ``engine/``, ``scheduling/``, ``outputs``, ``config/``); only
``server/`` (and ``testing/``) import it, the engine and the stages never do.

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

from __future__ import annotations

import importlib
from typing import Any

# name -> module: loaded on first use, so ``inferflow.config.tracing`` (the ``tracing``
# schema, imported by every CLI run) does not pull OpenTelemetry in.
_EXPORTS = {
    "EngineMetrics": "inferflow.telemetry.metrics",
    "EngineTelemetry": "inferflow.telemetry.engine_telemetry",
    "FinishedRequestStats": "inferflow.telemetry.metrics",
    "RequestSpan": "inferflow.telemetry.spans",
    "RequestTimings": "inferflow.telemetry.timings",
    "RequestTrace": "inferflow.telemetry.request_trace",
    "SchedulerSnapshot": "inferflow.telemetry.engine_telemetry",
    "ServerMetrics": "inferflow.telemetry.metrics_export",
    "StepStats": "inferflow.telemetry.metrics",
    "TracedExecutor": "inferflow.telemetry.traced_executor",
    "OtlpProtocol": "inferflow.config.tracing",
    "TracingConfig": "inferflow.config.tracing",
    "TracingConfigError": "inferflow.config.tracing",
    "TracingExporter": "inferflow.config.tracing",
    "cleanup_multiprocess_dir": "inferflow.telemetry.metrics_export",
    "emit_span": "inferflow.telemetry.spans",
    "extract_context": "inferflow.telemetry.spans",
    "flush_tracing": "inferflow.telemetry.setup",
    "get_tracer": "inferflow.telemetry.setup",
    "make_stage_wrapper": "inferflow.telemetry.spans",
    "mark_process_dead": "inferflow.telemetry.metrics_export",
    "phase_timing_headers": "inferflow.telemetry.timings",
    "prepare_multiprocess_dir": "inferflow.telemetry.metrics_export",
    "record_step_span": "inferflow.telemetry.spans",
    "render_metrics": "inferflow.telemetry.metrics_export",
    "resource_attributes": "inferflow.telemetry.setup",
    "setup_tracing": "inferflow.telemetry.setup",
    "shutdown_tracing": "inferflow.telemetry.setup",
    "stage_span": "inferflow.telemetry.spans",
    "start_request_span": "inferflow.telemetry.spans",
    "timing_headers": "inferflow.telemetry.timings",
    "traceparent_of": "inferflow.telemetry.spans",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
