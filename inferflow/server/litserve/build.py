"""``serve(graph)`` on the LitServe host: what ``python -m inferflow`` runs once the config is
composed.

Process tree of a running server (all bound to the main process with PR_SET_PDEATHSIG)::

    main: supervisor (signals, worker restarts, model loads)   <- SIGTERM / SIGINT go here
    ├── LitServe Manager (one request queue per LLM, one response queue per API process)
    ├── engine worker per loaded LLM (spawned): WorkerService + EngineLoop, owns the engine
    └── API process(es) (forked): uvicorn + FastAPI, OpenAI routes, request stages

An embedding-only graph runs the single-process ``process/embedding_server.py`` instead.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from inferflow.config import ConfigError
from inferflow.config.server import ServerConfig
from inferflow.embeddings.models import embedding_specs
from inferflow.server.http.frontend import Frontend
from inferflow.server.litserve.litserver import InferflowServer, engine_api
from inferflow.server.observability import FrontendTelemetry
from inferflow.server.process.model_manager import ManagedModel, estimate_model_bytes
from inferflow.server.process.runtime import (
    ServerFailed,
    llm_deployments,
    start_line,
    telemetry_settings,
)
from inferflow.server.shared_state import SharedState
from inferflow.server.worker.service import GraphEngineFactory, WorkerService
from inferflow.telemetry.metrics_export import cleanup_multiprocess_dir, prepare_multiprocess_dir

if TYPE_CHECKING:
    from inferflow.graph import ServingGraph

logger = logging.getLogger(__name__)


def build_server(graph: ServingGraph, settings: ServerConfig | None = None) -> InferflowServer:
    """Wire the frontend and an engine worker per LLM of ``graph`` into LitServe's host."""
    settings = settings or graph.server.with_env_api_keys()
    config = graph.to_container()
    telemetry = telemetry_settings(graph, config)
    frontend_telemetry = FrontendTelemetry(telemetry)
    deployments = llm_deployments(graph, frontend_telemetry)
    if not deployments:
        raise ConfigError(
            "models: no LLM entry (an embedding-only server is +model=minilm)", "models"
        )
    first = deployments[0][0]
    frontend = Frontend(
        [d for d, _ in deployments],
        settings,
        SharedState(),  # the server's own flags (draining, queue lost, ready)
        frontend_telemetry,
    )
    frontend.serve_embeddings(embedding_specs(graph))  # encoders live in each API process
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
            lora=deployment.lora,
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


def serve(graph: ServingGraph) -> int | None:
    """Serve ``graph`` on ``server.host:server.port`` until SIGTERM/SIGINT (blocking).

    Returns after a clean, drained shutdown: the signal that stopped the server (None when it
    was not one, or for an embedding-only server: uvicorn raises its signal again); raises :class:`ServerFailed` when the engine
    worker could not start or an API process died. Prometheus samples of every process go to
    a temporary multiprocess directory that is removed on the way out.
    """
    if graph.model.is_embedding and not graph.config.get("models"):
        # no LLM: one process, no engine worker
        from inferflow.server.process.embedding_server import serve_embeddings

        serve_embeddings(graph)
        return None
    metrics_dir = prepare_multiprocess_dir()
    try:
        server = build_server(graph)
        server.run()
    finally:
        cleanup_multiprocess_dir(metrics_dir)
    if server.exit_code:
        raise ServerFailed("the server stopped after a failure; see the log above")
    return server.stop_signal
