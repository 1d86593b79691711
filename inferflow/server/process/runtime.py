"""``serve(graph)``: what ``python -m inferflow`` runs once the config is composed.

Process tree of a running server (all bound to the main process with PR_SET_PDEATHSIG)::

    main: supervisor (signals, worker restarts, model loads)   <- SIGTERM / SIGINT go here
    ├── LitServe Manager (one request queue per LLM, one response queue per API process)
    ├── engine worker per loaded LLM (spawned): WorkerService + EngineLoop, owns the engine
    └── API process(es) (forked): uvicorn + FastAPI, OpenAI routes, request stages

The LLMs are the model repository's entries (``inferflow.graph.repository``; without
``models:`` the one ``model``): each gets its own serving graph, request stages, shared state
and engine worker.
"""

from __future__ import annotations

import logging
from typing import Any

from inferflow.config import ConfigError
from inferflow.config.server import ServerConfig
from inferflow.embeddings.models import embedding_specs
from inferflow.graph import build_entry_graph
from inferflow.graph.repository import llm_entries
from inferflow.server.http.deployments import Deployment
from inferflow.server.http.embeddings import EmbeddingModels, EmbeddingsFrontend
from inferflow.server.http.frontend import Frontend
from inferflow.server.http.pipeline import RequestPipeline
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.litserve.litserver import InferflowServer, engine_api
from inferflow.server.observability import FrontendTelemetry, TelemetrySettings
from inferflow.server.process.model_manager import ManagedModel, estimate_model_bytes
from inferflow.server.shared_state import SharedState
from inferflow.server.worker.service import GraphEngineFactory, WorkerService
from inferflow.telemetry.metrics_export import cleanup_multiprocess_dir, prepare_multiprocess_dir

logger = logging.getLogger(__name__)


class ServerFailed(RuntimeError):
    """The server stopped because a part of it failed (e.g. the engine could not be loaded)."""


def telemetry_settings(
    graph: Any, config: dict[str, Any], model_label: str | None = None
) -> TelemetrySettings:
    """Both sides' telemetry settings; the resource names the executor stage's backend.
    ``model_label``: the metrics' ``model_name`` (default: the served name)."""
    return TelemetrySettings(
        model_label or graph.model_name,
        dict(config.get("tracing") or {}),
        engine=graph.executor.backend,
        engine_version=graph.executor.package_version(),
    )


def _deployments(
    graph: Any, frontend_telemetry: FrontendTelemetry
) -> list[tuple[Deployment, Any]]:
    """Each LLM of the repository: its API-side ``Deployment`` and its serving graph."""
    out: list[tuple[Deployment, Any]] = []
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
        )
        if deployment.model_id in seen:
            raise ConfigError(
                f"models.{entry.key}: {deployment.model_id} is already served by "
                f"models.{seen[deployment.model_id]} (give one of them another model.version)",
                f"models.{entry.key}.model.version",
            )
        seen[deployment.model_id] = entry.key
        out.append((deployment, entry_graph))
    return out


def build_server(graph: Any, settings: ServerConfig | None = None) -> InferflowServer:
    """Wire the frontend and an engine worker per LLM of ``graph`` into LitServe's host."""
    settings = settings or graph.server.with_env_api_keys()
    config = graph.to_container()
    telemetry = telemetry_settings(graph, config)
    frontend_telemetry = FrontendTelemetry(telemetry)
    deployments = _deployments(graph, frontend_telemetry)
    if not deployments:
        raise ConfigError(
            "models: no LLM entry (an embedding-only server is +model=minilm)", "models"
        )
    first = deployments[0][0]
    frontend = Frontend(
        first.pipeline,
        settings,
        SharedState(),  # the server's own flags (draining, queue lost, ready)
        frontend_telemetry,
        first.responses,
        deployments=[d for d, _ in deployments],
    )
    specs = embedding_specs(graph)  # extra_models: encoders served in the API process
    if specs:
        frontend.embeddings = EmbeddingsFrontend(
            EmbeddingModels(specs),
            frontend.auth,
            frontend.is_draining,
            on_response=frontend_telemetry.on_response,
            tracer=lambda: frontend_telemetry.tracer,
            limiter=frontend.limiter,
        )
    models = []
    for index, (deployment, entry_graph) in enumerate(deployments):
        entry_config = entry_graph.to_container()
        service = WorkerService(
            GraphEngineFactory(entry_config),
            deployment.shared,
            # versions of one name: each its own series (model_name="NAME@VERSION")
            telemetry_settings(
                entry_graph,
                entry_config,
                deployment.model_id if len(frontend.router.by_name[deployment.name]) > 1 else None,
            ),
        )
        api = engine_api(index, service, frontend, deployment.model_path, settings.log_level)
        models.append(
            ManagedModel(
                deployment.key,
                deployment.model_id,
                deployment.load,
                api,
                deployment.shared,
                estimate_model_bytes(entry_graph),
            )
        )
    budget = graph.server.model_memory_budget_bytes
    if budget is not None and not any(d.load.value == "on_demand" for d, _ in deployments):
        logger.warning(
            "server.model_memory_budget applies to on-demand models of the repository (models:"
            " ... load: on_demand); with none, nothing is loaded or unloaded by it"
        )
    return InferflowServer(
        models,
        frontend,
        settings,
        first.model_path,
        start_line(graph, settings, [d for d, _ in deployments]),
        memory_budget=budget,
    )


def start_line(
    graph: Any, settings: ServerConfig, deployments: list[Deployment] | None = None
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


def _trace_target(tr: Any) -> str:
    if tr.exporter == "file":
        return f"file {tr.resolved_file_path()}"
    if tr.exporter in ("otlp", "jaeger"):
        return f"{tr.exporter} {tr.resolved_endpoint()}"
    return str(tr.exporter)


def serve(graph: Any) -> None:
    """Serve ``graph`` on ``server.host:server.port`` until SIGTERM/SIGINT (blocking).

    Returns after a clean, drained shutdown; raises :class:`ServerFailed` when the engine
    worker could not start or an API process died. Prometheus samples of every process go to
    a temporary multiprocess directory that is removed on the way out.
    """
    if graph.model.is_embedding and not graph.config.get("models"):
        # no LLM: one process, no engine worker
        from inferflow.server.process.embedding_server import serve_embeddings

        serve_embeddings(graph)
        return
    metrics_dir = prepare_multiprocess_dir()
    try:
        server = build_server(graph)
        server.run()
    finally:
        cleanup_multiprocess_dir(metrics_dir)
    if server.exit_code:
        raise ServerFailed("the server stopped after a failure; see the log above")
