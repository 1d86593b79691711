"""``inferflow.telemetry`` at the server's boundaries, one wrapper per boundary.

API process (``FrontendTelemetry``, built after the fork, in the lifespan):

- a root SERVER span per request (``start_request_span``, honouring an incoming ``traceparent``),
  ended when the response is complete, with usage, finish reason, timings and HTTP status;
- a span per request stage (``RequestPipeline.wrap_stage``);
- HTTP response counts and durations per route and status, served with the engine's metrics on
  ``GET /metrics`` (Prometheus multiprocess directory shared by every process).

Engine worker (``WorkerTelemetry``, built in ``EngineAPI.setup``):

- an ``EngineTelemetry`` told when the engine accepts and finishes a request (queue, prefill and
  decode spans; TTFT/TPOT/e2e histograms), and a ``TracedExecutor`` around the engine's executor
  (one span and metrics per step). Its ``RequestTimings`` travel back with the final update.

Telemetry calls are failure-isolated: they never fail a request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from inferflow.engine.step import Executor
from inferflow.outputs import RequestMetrics
from inferflow.server.messages import SubmitRequest
from inferflow.stages.base import StageRequest
from inferflow.telemetry import attributes as A
from inferflow.telemetry.timings import RequestTimings

if TYPE_CHECKING:
    from inferflow.telemetry.spans import RequestSpan

logger = logging.getLogger(__name__)

ATTR_TRACE_CONTEXT = "trace_context"  # StageRequest.attributes: the root span's W3C carrier


@dataclass(frozen=True)
class TelemetrySettings:
    """What both sides need to set telemetry up; plain data, so it pickles into the worker."""

    model_name: str
    tracing: dict[str, Any] = field(default_factory=lambda: {"exporter": "off"})
    engine: str = "onnxruntime"  # the executor stage's backend: what really runs
    engine_version: str | None = None
    replica_id: str | None = None  # Ray host: the engine replica (``service.instance.id``)

    def tracer(self) -> tuple[Any, Any]:
        """This process's (provider, tracer) from the ``tracing`` config."""
        from inferflow.telemetry import (
            TracingConfig,
            get_tracer,
            resource_attributes,
            setup_tracing,
        )

        attrs = resource_attributes(
            model_name=self.model_name, engine=self.engine, engine_version=self.engine_version
        )
        if self.replica_id is not None:
            attrs["service.instance.id"] = self.replica_id
        provider = setup_tracing(TracingConfig.from_mapping(self.tracing), attrs)
        return provider, get_tracer(provider)


class FrontendTelemetry:
    """Per-API-process tracer and HTTP metrics. Inert until ``start()``."""

    def __init__(self, settings: TelemetrySettings | None) -> None:
        self.settings = settings
        self.tracer: Any = None
        self._provider: Any = None
        self._stage_wrapper: Any = None
        self.server_metrics: Any = None

    def start(self) -> None:
        if self.settings is None:
            return
        from inferflow.telemetry import ServerMetrics, make_stage_wrapper

        self._provider, self.tracer = self.settings.tracer()
        self._stage_wrapper = make_stage_wrapper(
            self.tracer, lambda request: request.attributes.get(ATTR_TRACE_CONTEXT)
        )
        self.server_metrics = ServerMetrics(self.settings.model_name)

    def stop(self) -> None:
        if self._provider is not None:
            from inferflow.telemetry import shutdown_tracing

            shutdown_tracing(self._provider)

    def wrap_stage(self, name: str, request: StageRequest) -> AbstractContextManager[Any]:
        if self._stage_wrapper is None:
            return nullcontext()
        return self._stage_wrapper(name, request)

    def start_request(
        self, operation: str, model: str, headers: Mapping[str, str], params: Any
    ) -> RequestSpan | None:
        """The root span of one request (``None`` when telemetry is off)."""
        if self.tracer is None:
            return None
        from inferflow.telemetry import start_request_span

        return start_request_span(
            self.tracer,
            operation=operation,
            model=model,
            headers=headers,
            max_tokens=getattr(params, "requested_max_tokens", params.max_tokens),
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
        )

    def model_load(
        self, span: RequestSpan | None, model_id: str, started: float, ended: float, outcome: str
    ) -> None:
        """The time a request waited for its on-demand model to load: a ``model_load`` child
        span of its root span and ``inferflow:model_load_wait_seconds``."""
        if self.server_metrics is not None:
            try:
                self.server_metrics.on_model_load_wait(model_id, outcome, ended - started)
            except Exception as exc:  # metrics never fail a request
                logger.debug("metrics: %s", exc)
        if self.tracer is None or span is None:
            return
        from inferflow.telemetry.spans import emit_span

        emit_span(
            self.tracer,
            "model_load",
            parent=span,
            start_time=started,
            end_time=ended,
            attributes={"inferflow.model.id": model_id, "inferflow.model_load.outcome": outcome},
        )

    def on_response(self, route: str, status_code: int, duration_s: float) -> None:
        if self.server_metrics is not None:
            try:
                self.server_metrics.on_response(route, status_code, duration_s)
            except Exception as exc:  # metrics never fail a request
                logger.debug("metrics: %s", exc)

    def render_metrics(self) -> tuple[bytes, str]:
        from inferflow.telemetry import render_metrics

        registries = [self.server_metrics.registry] if self.server_metrics is not None else []
        return render_metrics(*registries)


class WorkerTelemetry:
    """The engine side: ``EngineTelemetry`` plus a ``TracedExecutor`` around the executor,
    attached when the engine is built (``wrap_executor``) and recording once
    ``start_recording()`` is called (after the warm-up)."""

    def __init__(self, settings: TelemetrySettings, worker_id: int = 0) -> None:
        from inferflow.telemetry import EngineMetrics, EngineTelemetry

        self._provider, tracer = settings.tracer()
        self.telemetry = EngineTelemetry(tracer, EngineMetrics(settings.model_name, worker_id))
        self._recording = False

    def wrap_executor(self, executor: Executor, stats: Callable[[], Any]) -> Executor:
        from inferflow.telemetry import TracedExecutor

        return TracedExecutor(
            executor, self.telemetry, snapshot=stats, active=lambda: self._recording
        )

    def start_recording(self) -> None:
        self._recording = True

    def engine_state(self, running: int, waiting: int, kv_used: int, kv_total: int) -> None:
        """The engine's state after a loop iteration (gauges return to idle without a step)."""
        metrics = self.telemetry.metrics
        if metrics is not None and self._recording:
            try:
                metrics.set_state(running, waiting, kv_used, kv_total)
            except Exception as exc:  # telemetry never fails the engine
                logger.debug("metrics: %s", exc)

    def request_added(self, request: SubmitRequest, accepted_time: float) -> None:
        """The engine's side of the request starts at ``accepted_time``; the hop from the API
        process (submitted after the request stages) is an attribute of its span."""
        self.telemetry.on_request_arrived(
            request.request_id,
            num_prompt_tokens=len(request.prompt_token_ids),
            trace_context=request.trace_context or None,
            arrival_time=accepted_time,
            max_tokens=request.params.max_tokens,
            operation=request.operation,
            attributes={
                A.SUBMIT_DELAY: max(0.0, accepted_time - request.arrival_time),
                **({A.LORA_NAME: request.lora} if request.lora is not None else {}),
            },
        )

    def request_done(
        self,
        request_id: str,
        finish_reason: str,
        metrics: RequestMetrics | None,
        num_output_tokens: int | None,
        error: str | None = None,
    ) -> RequestTimings | None:
        """Emit the request's spans and metrics; returns its timings."""
        return self.telemetry.on_request_finished(
            request_id,
            finish_reason,
            metrics=metrics,
            num_cached_tokens=metrics.num_cached_prompt_tokens if metrics else None,
            num_output_tokens=num_output_tokens,
            error=error,
        )

    def metrics_text(self) -> str:
        """This engine's Prometheus samples (its in-memory registry), as exposition text."""
        from prometheus_client import generate_latest

        metrics = self.telemetry.metrics
        return generate_latest(metrics.registry).decode() if metrics is not None else ""

    def shutdown(self) -> None:
        from inferflow.telemetry import shutdown_tracing

        shutdown_tracing(self._provider)
