"""The ``tracing`` config group: the one ``TracingConfig`` (Hydra schema and runtime settings).

Light on purpose (no OpenTelemetry import): the schema of the ``tracing`` group;
``inferflow.telemetry.setup`` builds the exporters from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlsplit

from inferflow.config.base import ConfigEnum
from inferflow.paths import inferflow_home

DEFAULT_GRPC_ENDPOINT = "http://localhost:4317"
DEFAULT_HTTP_ENDPOINT = "http://localhost:4318/v1/traces"


class TracingExporter(ConfigEnum):
    off = "off"
    file = "file"
    console = "console"
    otlp = "otlp"
    jaeger = "jaeger"


class OtlpProtocol(ConfigEnum):
    grpc = "grpc"
    http = "http"



class TracingConfigError(ValueError):
    """A tracing setting is invalid; ``field`` names it (``tracing.<field>``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"tracing.{field_name}: {message}")
        self.field = field_name


def _parse_headers(value: Mapping[str, str] | str | None) -> dict[str, str]:
    """``{"k": "v"}`` or ``"k=v,k2=v2"`` (OTEL_EXPORTER_OTLP_HEADERS style) -> dict."""
    if value is None:
        return {}
    if isinstance(value, str):
        pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
        if any(len(p) != 2 for p in pairs):
            raise TracingConfigError("headers", f"expected 'key=value,...', got {value!r}")
        return {k.strip(): v.strip() for k, v in pairs}
    return {str(k): str(v) for k, v in value.items()}


@dataclass
class TracingConfig:
    """The ``tracing`` config group.

    ``exporter``: ``off`` (no spans recorded), ``file`` (OTLP-JSON lines at ``file_path``; the
    default), ``console`` (one JSON span per line on stdout), ``otlp`` (OTLP over ``protocol`` to
    ``endpoint`` with ``headers``), ``jaeger`` (OTLP gRPC to a local Jaeger, default
    ``http://localhost:4317``). ``sample_ratio`` is the share of new traces kept
    (``ParentBased(TraceIdRatioBased)``: an incoming sampled/unsampled traceparent is obeyed).
    ``file_path=None`` means ``$INFERFLOW_HOME/traces/traces.jsonl`` (``~/.cache/inferflow``);
    past ``max_file_mb`` it is rotated to ``traces.jsonl.1`` (``backup_count`` files kept).
    """

    exporter: TracingExporter = TracingExporter.file
    endpoint: str | None = None
    protocol: OtlpProtocol = OtlpProtocol.grpc
    headers: dict[str, str] = field(default_factory=dict)
    sample_ratio: float = 1.0
    file_path: str | None = None
    service_name: str = "inferflow"
    export_timeout_s: float = 10.0
    max_file_mb: float = 64.0  # file exporter: rotate past this size (0 = never)
    backup_count: int = 3  # file exporter: rotated files kept (traces.jsonl.1 ... .N)

    def __post_init__(self) -> None:
        # plain strings (Python callers) become the enums (what Hydra hands over)
        for name, enum in (("exporter", TracingExporter), ("protocol", OtlpProtocol)):
            value = getattr(self, name)
            try:
                setattr(self, name, enum(getattr(value, "value", value)))
            except ValueError:
                choices = "|".join(e.value for e in enum)
                raise TracingConfigError(name, f"must be one of {choices}, got {value!r}") from None
        self.headers = _parse_headers(self.headers)
        if (
            not isinstance(self.sample_ratio, int | float)
            or not 0.0 <= float(self.sample_ratio) <= 1.0
        ):
            raise TracingConfigError(
                "sample_ratio", f"must be in [0, 1], got {self.sample_ratio!r}"
            )
        if self.endpoint is not None:
            url = urlsplit(self.endpoint)
            if url.scheme not in ("http", "https") or not url.netloc:
                raise TracingConfigError(
                    "endpoint", f"must be a URL like http://host:4317, got {self.endpoint!r}"
                )
        if not self.service_name:
            raise TracingConfigError("service_name", "must not be empty")
        if self.export_timeout_s <= 0:
            raise TracingConfigError("export_timeout_s", "must be > 0")
        if self.max_file_mb < 0:
            raise TracingConfigError("max_file_mb", "must be >= 0 (0 = never rotate)")
        if self.backup_count < 0:
            raise TracingConfigError("backup_count", "must be >= 0")

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> TracingConfig:
        """Build from a plain mapping (e.g. ``OmegaConf.to_container(cfg.tracing)``). Keys starting
        with ``_`` (``_target_``) are ignored; an unknown key raises naming it."""
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if not k.startswith("_")}
        for key in kwargs:
            if key not in known:
                raise TracingConfigError(key, f"unknown field (known: {', '.join(sorted(known))})")
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def effective_protocol(self) -> str:
        return "grpc" if self.exporter == "jaeger" else self.protocol

    def resolved_endpoint(self) -> str:
        """Endpoint URL; for HTTP a bare ``http://host:4318`` gets the ``/v1/traces`` path."""
        if self.effective_protocol == "grpc":
            return self.endpoint or DEFAULT_GRPC_ENDPOINT
        if self.endpoint is None:
            return DEFAULT_HTTP_ENDPOINT
        if urlsplit(self.endpoint).path in ("", "/"):
            return self.endpoint.rstrip("/") + "/v1/traces"
        return self.endpoint

    def resolved_file_path(self) -> Path:
        if self.file_path:
            return Path(self.file_path).expanduser()
        return inferflow_home() / "traces" / "traces.jsonl"
