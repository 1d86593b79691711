"""The ingress deployment of the Ray host: inferflow's own OpenAI routes on Ray Serve's proxy.

The ingress replica runs the same ``Frontend`` as an API process of the single-machine server
(request stages, limits, SSE, tracing root span); only its two neighbours change:

- ``EngineClient`` stands where LitServe's request queue stood: ``put(SubmitRequest)`` starts a
  streaming ``DeploymentHandle`` call to the engine deployment (routed by the deployment's
  request router) and feeds each ``RequestUpdate`` to the request's channel; ``put(
  CancelRequest)`` cancels that call (and so the request in its replica). A replica that dies
  fails its calls at once with a 503 ``replica_lost``.
- the ``SharedState`` the routes read is filled from the replicas' reports (``board.py``): ready,
  summed stats, the engine description; ``/admin/stats`` adds each replica and ``/metrics``
  each replica's samples labelled ``replica``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from inferflow.config import LoadMode
from inferflow.config.server import ServerConfig
from inferflow.embeddings.models import embedding_specs
from inferflow.server.http.deployments import Deployment
from inferflow.server.http.embeddings import EmbeddingModels, EmbeddingsFrontend
from inferflow.server.http.errors import install_error_handlers
from inferflow.server.http.frontend import Frontend
from inferflow.server.http.limits import DocsKeyMiddleware, PayloadLimitMiddleware
from inferflow.server.http.openapi import install_openapi
from inferflow.server.http.ops import api_routes
from inferflow.server.http.pipeline import RequestPipeline
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.messages import (
    CancelRequest,
    ErrorInfo,
    RequestUpdate,
    SubmitRequest,
    UpdateBatch,
)
from inferflow.server.observability import FrontendTelemetry, TelemetrySettings
from inferflow.server.ray.board import board_actor, merge_metrics
from inferflow.server.shared_state import STATS_FIELDS, LoadState, SharedState

logger = logging.getLogger(__name__)

READ_S = 1.0  # how often the ingress reads the replicas' reports

# every engine counter and gauge adds up across replicas, but the writer's pid and time stamp
_SUMMED = tuple(f for f in STATS_FIELDS if f not in ("worker_pid", "updated_at"))


class EngineClient:
    """The frontend's request queue on the Ray host (``put`` from the event loop thread)."""

    def __init__(self, handle: Any, frontend: Frontend) -> None:
        self.handle = handle.options(stream=True)
        self.frontend = frontend
        self._calls: dict[str, asyncio.Task[None]] = {}

    def put(self, message: Any) -> None:
        if isinstance(message, SubmitRequest):
            task = asyncio.get_running_loop().create_task(self._run(message))
            self._calls[message.request_id] = task
        elif isinstance(message, CancelRequest):
            running = self._calls.pop(message.request_id, None)
            if running is not None:
                running.cancel()

    def _deliver(self, update: RequestUpdate) -> None:
        self.frontend.registry.dispatch(UpdateBatch((update,)))

    async def _run(self, request: SubmitRequest) -> None:
        call = self.handle.generate.remote(request)
        try:
            async for item in call:
                update: RequestUpdate = pickle.loads(item)  # from our own engine replica
                self._deliver(update)
                if update.final:
                    return
            error = ErrorInfo(502, "the engine replica ended the stream early", code="replica_lost")
        except asyncio.CancelledError:
            call.cancel()  # the replica's generator is cancelled: it cancels the request
            raise
        except Exception as exc:  # the replica died or became unreachable mid-request
            logger.warning("request %s: engine replica lost: %s", request.request_id, exc)
            error = ErrorInfo(503, "the engine replica serving this request was lost; retry",
                              code="replica_lost", retry_after_s=1)
        finally:
            self._calls.pop(request.request_id, None)
        self._deliver(RequestUpdate(request_id=request.request_id, error=error))


class BoardReader:
    """Keeps the ingress's ``SharedState`` current from the replicas' reports (a thread)."""

    def __init__(self, board_name: str, shared: SharedState, required_replicas: int) -> None:
        self.board_name, self.shared = board_name, shared
        self.required = required_replicas
        self.replicas: dict[str, dict[str, Any]] = {}
        self._seen_ready = False  # readiness: every initial replica loaded once, then >= 1
        threading.Thread(target=self._run, name="inferflow-board-reader", daemon=True).start()

    def _run(self) -> None:
        import ray

        board = None
        while True:
            try:
                board = board or board_actor(self.board_name)
                self.apply(ray.get(board.read.remote(), timeout=5))
            except Exception as exc:
                logger.debug("replica board: %s", exc)
                board = None
            threading.Event().wait(READ_S)

    def apply(self, replicas: dict[str, dict[str, Any]]) -> None:
        self.replicas = replicas
        ready = [r for r in replicas.values() if r.get("ready")]
        self._seen_ready = self._seen_ready or len(ready) >= self.required
        self.shared.set_ready(self._seen_ready and bool(ready))
        if ready:
            self.shared.beat()
            self.shared.publish_info(ready[0].get("info") or {})
        totals = {k: float(sum(r["stats"].get(k, 0) for r in ready)) for k in _SUMMED}
        # the executor counters of one replica (each replica's are in /admin/stats "replicas")
        self.shared.publish_stats(totals, executor=ready[0].get("executor") if ready else None)


class IngressDeployment:
    """The ingress deployment's class (``serve.ingress()``: the app is built per replica)."""

    def __init__(self, engine: Any, config: dict[str, Any], telemetry: TelemetrySettings,
                 board_name: str, required_replicas: int) -> None:
        from inferflow.graph import build_graph

        graph = build_graph(config)
        self.settings = graph.server.with_env_api_keys()
        self.telemetry = FrontendTelemetry(telemetry)
        self.shared = SharedState()
        pipeline = RequestPipeline.from_graph(graph, wrap_stage=self.telemetry.wrap_stage)
        responses = ResponsePipeline(graph.response_stages)
        self.shared.set_load_state(LoadState.LOADED)  # the engine replicas' readiness: ready
        model = Deployment("", graph.model_name, str(graph.model.version), LoadMode.eager,
                           pipeline, self.shared, responses, str(graph.model_path))
        self.frontend = Frontend(pipeline, self.settings, self.shared, self.telemetry, responses,
                                 deployments=[model])
        self.frontend.request_queue = EngineClient(engine, self.frontend)
        specs = embedding_specs(graph)  # extra_models: encoders in the ingress, as in API processes
        if specs:
            embeddings = EmbeddingsFrontend(
                EmbeddingModels(specs), self.frontend.auth, self.frontend.is_draining,
                on_response=self.telemetry.on_response, tracer=lambda: self.telemetry.tracer,
                limiter=self.frontend.limiter)
            self.frontend.embeddings = embeddings
            threading.Thread(target=embeddings.models.start, name="inferflow-encoders",
                             daemon=True).start()
        self.board = BoardReader(board_name, self.shared, required_replicas)
        self.model_path = str(graph.model_path)
        self.telemetry.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.frontend, self.board, self.model_path, self.settings)


def build_app(frontend: Frontend, board: BoardReader, model_path: str,
              settings: ServerConfig) -> FastAPI:
    """The FastAPI app: the OpenAI routes, the operational routes, our middleware and errors."""
    app = FastAPI(title="inferflow")
    app.add_middleware(DocsKeyMiddleware, auth=frontend.auth)
    app.add_middleware(PayloadLimitMiddleware, max_bytes=settings.max_payload_bytes)
    install_error_handlers(app)
    install_openapi(app, frontend.served_model_ids)
    routes = {path: (endpoint, methods) for path, endpoint, methods in api_routes(frontend, model_path)}
    stats_route, metrics_route = routes["/admin/stats"][0], routes["/metrics"][0]

    async def admin_stats(request: Request) -> JSONResponse:
        body = json.loads((await stats_route(request)).body)
        body["replicas"] = {rid: {"ready": r.get("ready"), "pid": r.get("pid"), **r.get("stats", {})}
                            for rid, r in board.replicas.items()}
        return JSONResponse(body)

    async def metrics(request: Request) -> Response:
        own = (await metrics_route(request)).body.decode()
        replicas = merge_metrics({rid: r.get("metrics") or "" for rid, r in board.replicas.items()})
        return Response(own + replicas, media_type="text/plain; version=0.0.4; charset=utf-8")

    routes["/admin/stats"] = (admin_stats, ["GET"])
    routes["/metrics"] = (metrics, ["GET"])
    for path, (endpoint, methods) in routes.items():
        app.add_api_route(path, endpoint, methods=methods)
    return app
