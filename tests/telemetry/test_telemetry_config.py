"""The tracing config group: validation with field-named errors, endpoint/file resolution,
exporter choice, explicit (non-global) providers, and ``jaeger`` = OTLP gRPC."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.trace.export import ConsoleSpanExporter
from otlp_receiver import GrpcOtlpReceiver

from inferflow.telemetry import (
    TracingConfig,
    TracingConfigError,
    TracingExporter,
    flush_tracing,
    get_tracer,
    setup_tracing,
    shutdown_tracing,
    stage_span,
)
from inferflow.telemetry.otlp_json import OtlpJsonFileSpanExporter
from inferflow.telemetry.setup import make_exporter


@pytest.mark.parametrize(
    ("fields", "bad_field"),
    [
        ({"exporter": "zipkin"}, "exporter"),
        ({"protocol": "thrift"}, "protocol"),
        ({"sample_ratio": 1.5}, "sample_ratio"),
        ({"sample_ratio": "all"}, "sample_ratio"),
        ({"endpoint": "localhost:4317"}, "endpoint"),
        ({"headers": "novalue"}, "headers"),
        ({"service_name": ""}, "service_name"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_bad_fields_are_named(fields: dict, bad_field: str) -> None:
    with pytest.raises(TracingConfigError) as exc:
        TracingConfig.from_mapping(fields)
    assert exc.value.field == bad_field and str(exc.value).startswith(f"tracing.{bad_field}:")


def test_from_mapping_and_defaults() -> None:
    cfg = TracingConfig.from_mapping(
        {"_target_": "ignored", "exporter": "otlp", "protocol": "http", "headers": "a=1, b = two"}
    )
    assert cfg.headers == {"a": "1", "b": "two"}
    assert cfg.resolved_endpoint() == "http://localhost:4318/v1/traces"
    assert TracingConfig().exporter == "file" and TracingConfig().sample_ratio == 1.0
    assert TracingConfig(exporter="otlp").resolved_endpoint() == "http://localhost:4317"
    bare = TracingConfig(exporter="otlp", protocol="http", endpoint="http://collector:4318/")
    assert bare.resolved_endpoint() == "http://collector:4318/v1/traces"
    custom = TracingConfig(
        exporter="otlp", protocol="http", endpoint="https://x.example/otlp/traces"
    )
    assert custom.resolved_endpoint() == "https://x.example/otlp/traces"
    jaeger = TracingConfig(exporter="jaeger", protocol="http")  # jaeger is always OTLP gRPC
    assert (
        jaeger.effective_protocol == "grpc"
        and jaeger.resolved_endpoint() == "http://localhost:4317"
    )


def test_strings_and_other_enums_become_the_config_enums() -> None:
    """One TracingConfig is both the Hydra schema and the runtime settings."""

    class Exporter(str, enum.Enum):
        otlp = "otlp"

    class Protocol(str, enum.Enum):
        http = "http"

    cfg = TracingConfig.from_mapping({"exporter": Exporter.otlp, "protocol": Protocol.http})
    assert cfg.exporter is TracingExporter.otlp and cfg.exporter == "otlp" and cfg.protocol == "http"
    assert TracingConfig(exporter="file").exporter is TracingExporter.file
    from inferflow import config

    assert config.TracingConfig is TracingConfig  # the schema of the `tracing` group
    assert cfg.resolved_endpoint() == "http://localhost:4318/v1/traces"


def test_file_path_default_lives_under_inferflow_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path / "home"))
    assert TracingConfig().resolved_file_path() == tmp_path / "home" / "traces" / "traces.jsonl"
    assert (
        TracingConfig(file_path=str(tmp_path / "t.jsonl")).resolved_file_path()
        == tmp_path / "t.jsonl"
    )


def test_exporter_choice(tmp_path: Path) -> None:
    assert make_exporter(TracingConfig(exporter="off")) is None
    file_exporter = make_exporter(TracingConfig(file_path=str(tmp_path / "a" / "t.jsonl")))
    assert isinstance(file_exporter, OtlpJsonFileSpanExporter) and (tmp_path / "a").is_dir()
    file_exporter.shutdown()
    assert isinstance(make_exporter(TracingConfig(exporter="console")), ConsoleSpanExporter)
    for cfg, cls in (
        (TracingConfig(exporter="otlp"), GrpcExporter),
        (TracingConfig(exporter="otlp", protocol="http"), HttpExporter),
        (TracingConfig(exporter="jaeger"), GrpcExporter),
    ):
        exporter = make_exporter(cfg)
        assert isinstance(exporter, cls)
        exporter.shutdown()


def test_providers_are_explicit_not_global(tmp_path: Path) -> None:
    before = trace.get_tracer_provider()
    provider = setup_tracing(
        TracingConfig(file_path=str(tmp_path / "t.jsonl")), {"inferflow.model.name": "m"}
    )
    assert trace.get_tracer_provider() is before
    assert provider.resource.attributes["inferflow.model.name"] == "m"
    assert provider.resource.attributes["service.name"] == "inferflow"
    shutdown_tracing(provider)
    shutdown_tracing(provider)  # idempotent


def test_jaeger_exporter_speaks_otlp_grpc() -> None:
    with GrpcOtlpReceiver() as rx:
        provider = setup_tracing(TracingConfig(exporter="jaeger", endpoint=rx.endpoint))
        with stage_span(get_tracer(provider), "tokenizer"):
            pass
        assert flush_tracing(provider)
        shutdown_tracing(provider)
        assert [s.name for s in rx.spans()] == ["tokenizer"]
