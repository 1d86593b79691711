"""The ingress deployment of the Ray host: inferflow's own OpenAI routes on Ray Serve's proxy.

The ingress replica runs the same ``Frontend`` as an API process of the single-machine server
(request stages, limits, SSE, tracing root span, the model repository's routing by ``model`` /
``name@version`` with the canary weights, LoRA adapters and the admin routes); only its
neighbours change:

- ``EngineHub`` (``engine_client.py``) stands where LitServe's request queues and the direct
  transport stood: one engine deployment per LLM of the repository, requests as handle calls,
  updates back in one message per engine flush;
- the ``SharedState`` of each model is filled from the replicas' reports (``ReplicaView``,
  ``replica_view.py``): ready (= routable), summed stats, the engine description, adapters;
  ``/admin/stats`` adds each replica and ``/metrics`` each replica's samples labelled
  ``replica``; ``/ready`` also waits for every ingress replica.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from inferflow.config.server import ServerConfig
from inferflow.embeddings.models import embedding_specs
from inferflow.server.http.errors import install_error_handlers
from inferflow.server.http.frontend import Frontend
from inferflow.server.http.limits import DocsKeyMiddleware, PayloadLimitMiddleware
from inferflow.server.http.openapi import install_openapi
from inferflow.server.http.ops import api_routes
from inferflow.server.observability import FrontendTelemetry, TelemetrySettings
from inferflow.server.process.runtime import llm_deployments
from inferflow.server.ray.board import merge_metrics
from inferflow.server.ray.engine_client import EngineHub, RayLoadRequests
from inferflow.server.ray.replica_view import ReplicaView
from inferflow.server.ray.transport import UpdateReceiver, node_address
from inferflow.server.shared_state import SharedState

logger = logging.getLogger(__name__)


class IngressDeployment:
    """The ingress deployment's class (``serve.ingress()``: the app is built per replica).

    ``engines``: each LLM's engine deployment handle by its ``models:`` key ("" for a lone
    model); ``required``: the replicas each must have routable before ``/ready`` (0: on
    demand); ``transport_key``: the key the update messages are signed with.
    """

    def __init__(
        self,
        engines: dict[str, Any],
        config: dict[str, Any],
        telemetry: TelemetrySettings,
        board_name: str,
        required: dict[str, int],
        transport_key: str = "",
        num_ingresses: int = 1,
    ) -> None:
        from ray import serve

        from inferflow.graph import build_graph

        graph = build_graph(config)
        self.settings = graph.server.with_env_api_keys()
        self.telemetry = FrontendTelemetry(telemetry)
        deployments = [d for d, _ in llm_deployments(graph, self.telemetry)]
        self.frontend = Frontend(deployments, self.settings, SharedState(), self.telemetry)
        receiver = UpdateReceiver(
            bytes.fromhex(transport_key) if transport_key else b"", node_address()
        )
        self.view: ReplicaView
        self.hub = EngineHub(
            engines,
            self.frontend,
            receiver,
            record_adapter=lambda *a: self.view.record_adapter(*a),
            routable=lambda key: self.view.routable_ids(key),
        )
        ingress_id = serve.get_replica_context().replica_id.unique_id
        self.view = ReplicaView(
            board_name, self.frontend, self.hub, required, ingress_id, num_ingresses
        )
        for d in deployments:
            d.request_queue = self.hub.queue(d.key)
        self.frontend.load_requests = RayLoadRequests(self.hub)
        # extra_models and embedding entries: encoders in the ingress, as in API processes
        self.frontend.serve_embeddings(embedding_specs(graph))
        if self.frontend.embeddings is not None:
            threading.Thread(
                target=self.frontend.embeddings.models.start, name="inferflow-encoders", daemon=True
            ).start()
        self.model_path = deployments[0].model_path
        self.telemetry.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_app(self.frontend, self.hub, self.view, self.model_path, self.settings)


def build_app(
    frontend: Frontend, hub: EngineHub, view: ReplicaView, model_path: str, settings: ServerConfig
) -> FastAPI:
    """The FastAPI app: the OpenAI routes, the operational routes, our middleware and errors.
    Its startup (on the replica's event loop) opens the update receiver and starts reading the
    board."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        hub.start()
        view.start()
        yield
        view.stop()
        hub.close()

    app = FastAPI(title="inferflow", lifespan=lifespan)
    app.add_middleware(DocsKeyMiddleware, auth=frontend.auth)
    app.add_middleware(PayloadLimitMiddleware, max_bytes=settings.max_payload_bytes)
    install_error_handlers(app)
    install_openapi(app, frontend.served_model_ids)
    routes = {
        path: (endpoint, methods) for path, endpoint, methods in api_routes(frontend, model_path)
    }
    stats_route, metrics_route = routes["/admin/stats"][0], routes["/metrics"][0]
    ready_route = routes["/ready"][0]

    async def ready() -> JSONResponse:
        response: JSONResponse = await ready_route()
        if response.status_code == 200 and not view.all_ingresses_ready():
            body = json.loads(bytes(response.body))
            body["status"] = "not_ready"  # another ingress replica cannot route yet
            return JSONResponse(body, status_code=503)
        return response

    async def admin_stats(request: Request) -> JSONResponse:
        body = json.loads((await stats_route(request)).body)
        body["replicas"] = {
            rid: {
                "ready": r.get("ready"),
                "pid": r.get("pid"),
                "model": r.get("model", ""),
                "routable": rid in view.routable.get(str(r.get("model", "")), ()),
                "adapters": sorted(a["name"] for a in (r.get("lora") or {}).get("adapters", ())),
                **r.get("stats", {}),
            }
            for rid, r in view.replicas.items()
        }
        return JSONResponse(body)

    async def metrics(request: Request) -> Response:
        own = (await metrics_route(request)).body.decode()
        replicas = merge_metrics({rid: r.get("metrics") or "" for rid, r in view.replicas.items()})
        return Response(own + replicas, media_type="text/plain; version=0.0.4; charset=utf-8")

    routes["/ready"] = (ready, ["GET"])
    routes["/admin/stats"] = (admin_stats, ["GET"])
    routes["/metrics"] = (metrics, ["GET"])
    for path in ("/admin/models/{name:path}/traffic", "/admin/models/{name:path}/promote"):
        routes[path] = (_shared_weights(routes[path][0], frontend, view), routes[path][1])
    for path, (endpoint, methods) in routes.items():
        app.add_api_route(path, endpoint, methods=methods)
    return app


def _shared_weights(route: Any, frontend: Frontend, view: ReplicaView) -> Any:
    """A canary route whose new weights also go to the board, for the other ingress replicas."""

    async def endpoint(name: str, request: Request) -> JSONResponse:
        response: JSONResponse = await route(name, request)
        if response.status_code == 200:
            versions = frontend.router.by_name.get(name, [])
            await view.publish_weights(name, {d.version: d.shared.weight for d in versions})
        return response

    endpoint.__doc__ = route.__doc__
    return endpoint
