"""Tracing configuration and TracerProvider construction (one provider per process).

Call :func:`setup_tracing` once in every process that emits spans — LitServe's API process (root
SERVER spans) and each inference worker (stage, queue, compute and engine-step spans) — and pass
the returned provider (or ``provider.get_tracer(...)``) explicitly. The global OpenTelemetry
provider is left alone unless ``set_global=True``.
"""

from __future__ import annotations

import os
import platform
import sys
import threading
import weakref
from collections.abc import Mapping, Sequence
from importlib import metadata
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from inferflow.config.tracing import TracingConfig
from inferflow.telemetry import attributes as A
from inferflow.telemetry import export_log
from inferflow.telemetry.otlp_json import OtlpJsonFileSpanExporter

TRACER_NAME = "inferflow"
SHUTDOWN_FLUSH_S = 1.5  # how long a shutting-down process waits for its last spans to export
_EXPORTERS: weakref.WeakKeyDictionary[trace.TracerProvider, SpanExporter] = (
    weakref.WeakKeyDictionary()
)


class LinkAwareRatioSampler(Sampler):
    """Root-span sampler: keeps a new trace when any of its span links is sampled (so an engine
    step span is kept whenever it served a traced request), otherwise by trace-id ratio."""

    def __init__(self, ratio: float) -> None:
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return self._ratio.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"LinkAwareRatioSampler{{{self._ratio.get_description()}}}"


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def resource_attributes(
    *,
    model_name: str | None = None,
    model_version: str | None = None,
    engine: str | None = None,
    engine_version: str | None = None,
    extra: Mapping[str, str | int | float | bool] | None = None,
) -> dict[str, str | int | float | bool]:
    """Resource attributes naming the service, model and engine/runtime versions.

    ``service.version`` is inferflow's version; runtime package versions are read from installed
    metadata (nothing is imported). ``extra`` entries win.
    """
    attrs: dict[str, str | int | float | bool] = {
        "service.version": _package_version("inferflow") or "0.0.0+unknown",
        "process.runtime.name": platform.python_implementation().lower(),
        "process.runtime.version": platform.python_version(),
    }
    for package in ("onnxruntime", "tensorrt", "litserve", "opentelemetry-sdk"):
        version = _package_version(package)
        if version is not None:
            attrs[f"inferflow.runtime.{package.replace('-', '_')}.version"] = version
    for key, value in (
        (A.RESOURCE_MODEL_NAME, model_name),
        (A.RESOURCE_MODEL_VERSION, model_version),
        (A.RESOURCE_ENGINE_NAME, engine),
        (A.RESOURCE_ENGINE_VERSION, engine_version),
    ):
        if value is not None:
            attrs[key] = value
    attrs.update(extra or {})
    return attrs


def make_exporter(cfg: TracingConfig) -> SpanExporter | None:
    """The span exporter for ``cfg.exporter`` (None for ``off``)."""
    if cfg.exporter == "off":
        return None
    if cfg.exporter == "file":
        return OtlpJsonFileSpanExporter(
            cfg.resolved_file_path(), int(cfg.max_file_mb * 1024 * 1024), cfg.backup_count
        )
    if cfg.exporter == "console":
        # sys.stdout as of setup time (the SDK's default is bound at its import)
        return ConsoleSpanExporter(
            out=sys.stdout, formatter=lambda span: span.to_json(indent=None) + os.linesep
        )
    endpoint = cfg.resolved_endpoint()
    if cfg.effective_protocol == "grpc":
        # imported lazily: grpc costs ~0.2 s at import and is not needed by other exporters
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        headers = {k.lower(): v for k, v in cfg.headers.items()}  # gRPC metadata keys are lowercase
        insecure = urlsplit(endpoint).scheme != "https"
        return OTLPSpanExporter(
            endpoint=endpoint, insecure=insecure, headers=headers, timeout=cfg.export_timeout_s
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpOTLPSpanExporter,
    )

    return HttpOTLPSpanExporter(
        endpoint=endpoint, headers=cfg.headers, timeout=cfg.export_timeout_s
    )


def setup_tracing(
    cfg: TracingConfig,
    resource_attrs: Mapping[str, str | int | float | bool] | None = None,
    *,
    set_global: bool = False,
) -> TracerProvider:
    """Build this process's TracerProvider from ``cfg``.

    ``off`` returns a provider whose spans are never recorded nor exported (``ALWAYS_OFF``).
    Otherwise spans go through a ``BatchSpanProcessor`` (export off the request path) with
    ``ParentBased(LinkAwareRatioSampler(sample_ratio))``. ``resource_attrs`` — typically
    :func:`resource_attributes` — plus ``service.name`` form the resource. Call
    :func:`shutdown_tracing` (or rely on the provider's atexit hook) to flush at exit.
    """
    attrs = dict(resource_attrs or {})
    attrs["service.name"] = cfg.service_name
    resource = Resource.create(attrs)
    exporter = make_exporter(cfg)
    if exporter is None:
        provider = TracerProvider(resource=resource, sampler=ALWAYS_OFF)
    else:
        sampler = ParentBased(root=LinkAwareRatioSampler(float(cfg.sample_ratio)))
        provider = TracerProvider(resource=resource, sampler=sampler)
        provider.add_span_processor(
            BatchSpanProcessor(exporter, export_timeout_millis=int(cfg.export_timeout_s * 1000))
        )
        _EXPORTERS[provider] = exporter
        if cfg.exporter in ("otlp", "jaeger"):
            export_log.install(cfg.resolved_endpoint())
    if set_global:
        trace.set_tracer_provider(provider)
    return provider


def get_tracer(provider: trace.TracerProvider) -> trace.Tracer:
    """inferflow's tracer (instrumentation scope ``inferflow``) from an explicit provider; for an
    ``off`` provider a no-op tracer, whose spans cost next to nothing."""
    if getattr(provider, "sampler", None) is ALWAYS_OFF:
        return trace.NoOpTracer()
    return provider.get_tracer(TRACER_NAME, _package_version("inferflow"))


def flush_tracing(provider: trace.TracerProvider, timeout_s: float = 10.0) -> bool:
    """Export everything finished so far; True when it all went out within ``timeout_s``."""
    flush = getattr(provider, "force_flush", None)
    return bool(flush(int(timeout_s * 1000))) if flush is not None else True


def shutdown_tracing(
    provider: trace.TracerProvider, flush_timeout_s: float = SHUTDOWN_FLUSH_S
) -> None:
    """Flush for at most ``flush_timeout_s``, then stop the exporters (idempotent): an
    unreachable collector never holds a shutdown for the exporter's whole retry budget."""
    exporter = _EXPORTERS.pop(provider, None)
    # the SDK's force_flush waits for a running export whatever its timeout: bound it here
    flusher = threading.Thread(
        target=flush_tracing,
        args=(provider, flush_timeout_s),
        name="inferflow-trace-flush",
        daemon=True,
    )
    flusher.start()
    flusher.join(flush_timeout_s)
    if exporter is not None:
        exporter.shutdown()  # interrupts the retries of a batch still being exported
    shutdown = getattr(provider, "shutdown", None)
    if shutdown is not None:
        shutdown()
