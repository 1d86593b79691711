"""``serve(graph)``: what ``python -m inferflow`` runs once the config is composed.

Process tree of a running server (all bound to the main process with PR_SET_PDEATHSIG)::

    main: supervisor (signals, worker restarts)    <- SIGTERM / SIGINT go here
    ├── LitServe Manager (request queue, one response queue per API process)
    ├── engine worker (spawned): EngineAPI + EngineLoop, owns the engine
    └── API process(es) (forked): uvicorn + FastAPI, OpenAI routes, request stages
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from inferflow.embeddings.http_api import EmbeddingModels, EmbeddingsFrontend
from inferflow.embeddings.models import embedding_specs
from inferflow.server.http.frontend import Frontend
from inferflow.server.http.pipeline import RequestPipeline
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.http.settings import ServerSettings
from inferflow.server.http.spec import OpenAICompatibleSpec
from inferflow.server.observability import FrontendTelemetry, TelemetrySettings
from inferflow.server.process.litserver import InferflowServer
from inferflow.server.process.shared_state import SharedState
from inferflow.server.worker.api import EngineAPI
from inferflow.telemetry.metrics_export import cleanup_multiprocess_dir, prepare_multiprocess_dir

if TYPE_CHECKING:
    from inferflow.engine.llm_engine import ExecutorWrapper, LLMEngine

logger = logging.getLogger(__name__)


class ServerFailed(RuntimeError):
    """The server stopped because a part of it failed (e.g. the engine could not be loaded)."""


@dataclass(frozen=True)
class GraphEngineFactory:
    """Rebuilds the graph from its plain config in the worker process and creates the engine."""

    config: dict[str, Any]

    def __call__(self, wrap_executor: ExecutorWrapper | None = None) -> LLMEngine:
        from inferflow.graph import build_graph

        return build_graph(self.config).create_engine(wrap_executor)


def telemetry_settings(graph: Any, config: dict[str, Any]) -> TelemetrySettings:
    """Both sides' telemetry settings; the resource names the executor stage's backend."""
    return TelemetrySettings(
        graph.model_name,
        dict(config.get("tracing") or {}),
        engine=graph.executor.backend,
        engine_version=graph.executor.package_version(),
    )


def build_server(graph: Any, settings: ServerSettings | None = None) -> InferflowServer:
    """Wire the frontend, the LitServe spec and the engine worker for ``graph``."""
    settings = settings or ServerSettings.from_config(graph.server)
    config = graph.to_container()
    telemetry = telemetry_settings(graph, config)
    frontend_telemetry = FrontendTelemetry(telemetry)
    shared = SharedState()
    pipeline = RequestPipeline.from_graph(graph, wrap_stage=frontend_telemetry.wrap_stage)
    responses = ResponsePipeline(graph.response_stages)  # set up with the request stages
    frontend = Frontend(pipeline, settings, shared, frontend_telemetry, responses)
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
    api = EngineAPI(
        GraphEngineFactory(config),
        shared,
        spec=OpenAICompatibleSpec(frontend, str(graph.model_path)),
        log_level=settings.log_level,
        telemetry=telemetry,
    )
    return InferflowServer(
        api, frontend, settings, str(graph.model_path), start_line(graph, settings)
    )


def start_line(graph: Any, settings: ServerSettings) -> str:
    """What is served, where, and where its traces go (printed once the server is ready)."""
    b, ex, tr = graph.batching, graph.executor, graph.tracing
    precision = getattr(ex, "precision", None)
    if tr.exporter == "file":
        target = f"file {tr.resolved_file_path()}"
    elif tr.exporter in ("otlp", "jaeger"):
        target = f"{tr.exporter} {tr.resolved_endpoint()}"
    else:
        target = str(tr.exporter)
    return (
        f"inferflow: ready: {graph.model_name} (version {graph.model.version}) at "
        f"http://{settings.host}:{settings.port}/v1 | executor {ex.backend}"
        f"{f' {precision}' if precision is not None else ''} | batching {b.mode} "
        f"(max_num_seqs {b.max_num_seqs}) | cache {'prefix' if graph.cache.enabled else 'off'}"
        f" | tracing {target}"
    )


def serve(graph: Any) -> None:
    """Serve ``graph`` on ``server.host:server.port`` until SIGTERM/SIGINT (blocking).

    Returns after a clean, drained shutdown; raises :class:`ServerFailed` when the engine
    worker could not start or an API process died. Prometheus samples of every process go to
    a temporary multiprocess directory that is removed on the way out.
    """
    from inferflow.embeddings.models import is_embedding_model

    if is_embedding_model(graph.model):  # no LLM: one process, no engine worker
        from inferflow.embeddings.server import serve_embeddings

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
