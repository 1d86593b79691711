"""What every host builds from a serving graph: the LLMs' deployments, the telemetry settings,
the start line, and ``ServerFailed``.

The LLMs are the model repository's entries (``inferflow.graph.repository``; without
``models:`` the one ``model``): each gets its own serving graph, request stages, shared state
and engine worker (``litserve/build.py``, ``ray/host.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferflow.config import ConfigError
from inferflow.config.server import ServerConfig
from inferflow.graph import build_entry_graph
from inferflow.graph.repository import llm_entries
from inferflow.server.http.deployments import Deployment
from inferflow.server.http.pipeline import RequestPipeline
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.lora import LoraServing
from inferflow.server.observability import FrontendTelemetry, TelemetrySettings
from inferflow.server.shared_state import SharedState

if TYPE_CHECKING:
    from inferflow.config.tracing import TracingConfig
    from inferflow.graph import ServingGraph


class ServerFailed(RuntimeError):
    """The server stopped because a part of it failed (e.g. the engine could not be loaded)."""


def telemetry_settings(
    graph: ServingGraph, config: dict[str, Any], model_label: str | None = None
) -> TelemetrySettings:
    """Both sides' telemetry settings; the resource names the executor stage's backend.
    ``model_label``: the metrics' ``model_name`` (default: the served name)."""
    return TelemetrySettings(
        model_label or graph.model_name,
        dict(config.get("tracing") or {}),
        engine=graph.executor.backend,
        engine_version=graph.executor.package_version(),
    )


def llm_deployments(
    graph: ServingGraph, frontend_telemetry: FrontendTelemetry
) -> list[tuple[Deployment, ServingGraph]]:
    """Each LLM of the repository: its API-side ``Deployment`` and its serving graph."""
    out: list[tuple[Deployment, ServingGraph]] = []
    seen: dict[str, str] = {}
    for entry in llm_entries(graph.config):
        entry_graph = build_entry_graph(entry) if entry.key else graph
        entry_graph.check_engine_settings()
        model = entry_graph.model
        deployment = Deployment(
            entry.key,
            entry_graph.model_name,
            str(model.version),
            entry.load,
            RequestPipeline.from_graph(entry_graph, wrap_stage=frontend_telemetry.wrap_stage),
            SharedState(weight=model.weight),
            ResponsePipeline(entry_graph.response_stages),  # set up with the request stages
            str(entry_graph.model_path),
            slots_hint=entry_graph.max_slots,
            lora=LoraServing.from_config(entry_graph.to_container()),
        )
        if deployment.model_id in seen:
            raise ConfigError(
                f"models.{entry.key}: {deployment.model_id} is already served by "
                f"models.{seen[deployment.model_id]} (give one of them another model.version)",
                f"models.{entry.key}.model.version",
            )
        seen[deployment.model_id] = entry.key
        out.append((deployment, entry_graph))
    _check_adapter_names([d for d, _ in out])
    return out


def start_line(
    graph: ServingGraph, settings: ServerConfig, deployments: list[Deployment] | None = None
) -> str:
    """What is served, where, and where its traces go (printed once the server is ready)."""
    if deployments and deployments[0].key:  # a repository: one line for all its models
        listed = ", ".join(
            f"{d.model_id}{' (on demand)' if d.load.value == 'on_demand' else ''}"
            for d in deployments
        )
        return (
            f"inferflow: ready: {len(deployments)} LLM(s) at http://{settings.host}:"
            f"{settings.port}/v1: {listed} | tracing {_trace_target(graph.tracing)}"
        )
    b, ex = graph.batching, graph.executor
    precision = getattr(ex, "precision", None)
    target = _trace_target(graph.tracing)
    return (
        f"inferflow: ready: {graph.model_name} (version {graph.model.version}) at "
        f"http://{settings.host}:{settings.port}/v1 | executor {ex.backend}"
        f"{f' {precision}' if precision is not None else ''} | batching {b.mode} "
        f"(max_num_seqs {b.max_num_seqs}) | cache {'prefix' if graph.cache.enabled else 'off'}"
        f" | tracing {target}"
    )


def _trace_target(tr: TracingConfig) -> str:
    if tr.exporter == "file":
        return f"file {tr.resolved_file_path()}"
    if tr.exporter in ("otlp", "jaeger"):
        return f"{tr.exporter} {tr.resolved_endpoint()}"
    return str(tr.exporter)


def _check_adapter_names(deployments: list[Deployment]) -> None:
    """An adapter name must name nothing else: no served model (a name or ``name@version``)
    and no adapter of another model (``model`` would be ambiguous)."""
    models = {name for d in deployments for name in (d.name, d.model_id)}
    owner: dict[str, Deployment] = {}
    for d in deployments:
        for name in d.lora.adapters if d.lora is not None else {}:
            where = f"models.{d.key}.lora.adapters.{name}" if d.key else f"lora.adapters.{name}"
            if name in models:
                raise ConfigError(
                    f"{where}: `{name}` is the name of a served model; give the adapter another "
                    "name", where,
                )
            if name in owner:
                raise ConfigError(
                    f"{where}: adapter `{name}` is already an adapter of "
                    f"{owner[name].model_id}; give it another name", where,
                )
            owner[name] = d
