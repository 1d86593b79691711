"""Operational routes: liveness, readiness, versions and an admin view of the engine.

They run in the API processes, where the engines do not live, so they read the state each
worker publishes (``SharedState``): ``/ready`` is 200 once every eager model's worker loaded its
engine, ran a warm-up step and started consuming requests (a model that failed to load is
reported with its error and does not hold the others back), and 503 while draining or when no
model can serve. Its body lists every model's status.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

import inferflow
from inferflow.config import LoadMode
from inferflow.json_types import JSONObject, JSONValue
from inferflow.models.families import SUPPORTED_ARCHITECTURES
from inferflow.server.http.deployments import Deployment, repository_metrics
from inferflow.server.http.embeddings import EMBEDDINGS_PATH
from inferflow.server.http.errors import OpenAIError
from inferflow.server.http.frontend import CHAT_PATH, COMPLETIONS_PATH, MODELS_PATH, Frontend
from inferflow.server.http.json_body import read_json_body
from inferflow.server.http.lora import lora_metrics, lora_routes
from inferflow.server.http.tokenization import tokenization_routes

_RUNTIME_PACKAGES = ("litserve", "fastapi", "uvicorn", "onnxruntime", "onnx", "numpy", "tokenizers")


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def runtime_versions() -> JSONObject:
    versions: JSONObject = {"python": platform.python_version()}
    versions.update({name: _version(name) for name in _RUNTIME_PACKAGES})
    return versions


def model_status(frontend: Frontend, deployment: Deployment) -> str:
    """One model's status (``Deployment.status``), ``stalled`` when its engine thread stopped
    going round (503 for it until it does or is restarted)."""
    status = deployment.status()
    stall = frontend.settings.worker_stall_timeout_s
    if status == "ready" and stall is not None and deployment.shared.heartbeat_age() > stall:
        return "stalled"
    return status


def readiness(frontend: Frontend) -> str:
    """``ready`` when every eager model is ready or failed and some model can serve (an
    on-demand one can, once loaded)."""
    if frontend.is_draining():
        return "draining"
    if frontend.embeddings is not None and not frontend.embeddings.models.ready:
        return "not_ready"
    statuses = [(d, model_status(frontend, d)) for d in frontend.deployments]
    if any(d.load is LoadMode.eager and s in ("loading", "not_ready", "unloaded")
           for d, s in statuses):
        return "not_ready"
    if any(s == "ready" or d.load is LoadMode.on_demand for d, s in statuses):
        return "ready"  # (an on-demand model that failed is tried again by a later request)
    return "stalled" if any(s == "stalled" for _, s in statuses) else "not_ready"


def describe_model(frontend: Frontend, deployment: Deployment) -> JSONObject:
    """One version for ``/ready``, ``/version``, ``/admin/stats`` and the admin answers: its
    ``describe()``, its status and its share of unpinned requests now (``effective_weight``)."""
    return {
        **deployment.describe(),
        "status": model_status(frontend, deployment),
        "effective_weight": frontend.router.effective_weight(deployment),
    }


Route = tuple[str, Callable[..., Any], list[str]]  # (path, endpoint, methods)


def api_routes(frontend: Frontend, model_path: str) -> list[Route]:
    """Every route of an API process, for either host to register: the OpenAI routes
    (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``, ``/v1/embeddings`` when
    encoders are served), vLLM's ``/tokenize`` and ``/detokenize`` (and its
    ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter`` under ``lora.allow_runtime_updates``), then ``/health``, ``/ready``, ``/version``, ``/metrics``,
    ``/admin/stats`` and the model repository's admin routes (every ``/admin/*`` route takes
    an admin key once keys are on: ``ApiKeyAuth.authorize_admin``)."""

    async def health() -> JSONResponse:
        """Liveness: the API process answers; says nothing about the model."""
        return JSONResponse({"status": "ok", "ready": readiness(frontend) == "ready"})

    async def ready() -> JSONResponse:
        status = readiness(frontend)
        models: list[JSONValue] = [describe_model(frontend, d) for d in frontend.deployments]
        body: JSONObject = {"status": status, "models": models}
        if frontend.embeddings is not None:
            body["embedding_models"] = {
                "status": "ready" if frontend.embeddings.models.ready else "loading"
            }
        return JSONResponse(body, status_code=200 if status == "ready" else 503)

    async def metrics(request: Request) -> Response:
        """Prometheus text: the engine's and every API process's metrics, merged. With API keys
        on it needs one too, unless ``server.public_metrics`` (scrapers without a key)."""
        if not frontend.settings.public_metrics:
            frontend.auth.authenticate(request.headers)
        body, content_type = frontend.telemetry.render_metrics()
        if frontend.deployments[0].key:  # a model repository: its state per version too
            body += repository_metrics(frontend.router)
        body += lora_metrics(frontend.deployments)  # (nothing without LoRA)
        return Response(content=body, media_type=content_type)

    embeddings = frontend.embeddings
    return [
        (COMPLETIONS_PATH, frontend.completions, ["POST"]),
        (CHAT_PATH, frontend.chat_completions, ["POST"]),
        (MODELS_PATH, frontend.models, ["GET"]),
        *([(EMBEDDINGS_PATH, embeddings.embeddings, ["POST"])] if embeddings is not None else []),
        *tokenization_routes(frontend),  # /tokenize, /detokenize (vLLM's)
        *lora_routes(frontend),  # /v1/load_lora_adapter, /v1/unload_lora_adapter (when allowed)
        ("/health", health, ["GET"]),
        ("/ready", ready, ["GET"]),
        ("/version", _version_route(frontend, model_path), ["GET"]),
        ("/metrics", metrics, ["GET"]),
        ("/admin/stats", _admin_stats_route(frontend), ["GET"]),
        # {name:path}: a served name may contain "/" (e.g. org/model)
        ("/admin/models/{name:path}/traffic", _traffic_route(frontend), ["POST"]),
        ("/admin/models/{name:path}/promote", _promote_route(frontend), ["POST"]),
    ]


def _traffic_route(frontend: Frontend) -> Callable[..., Any]:
    async def traffic(name: str, request: Request) -> JSONResponse:
        """Set the canary split of a model's versions: ``{"weights": {"1": 0.9, "2": 0.1}}``
        (versions not named get 0). Takes effect for the next request in every API process;
        requests in flight finish on the version they started on."""
        frontend.auth.authorize_admin(request.headers)
        body = await read_json_body(request)
        weights = body.get("weights") if isinstance(body, dict) else None
        try:
            if not isinstance(weights, dict) or not all(
                isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights.values()
            ):
                raise ValueError
            # (a huge int overflows; the isinstance only narrows what all() checked)
            shares = {str(k): float(v) for k, v in weights.items() if isinstance(v, int | float)}
        except (ValueError, OverflowError):
            raise OpenAIError.of(
                400, 'weights: expected {"weights": {"VERSION": number, ...}}', param="weights"
            ) from None
        return _set_weights(frontend, name, shares, "weights")

    return traffic


def _promote_route(frontend: Frontend) -> Callable[..., Any]:
    async def promote(name: str, request: Request) -> JSONResponse:
        """All unpinned traffic of a model to one version: ``{"version": "2"}``."""
        frontend.auth.authorize_admin(request.headers)
        body = await read_json_body(request)
        version = body.get("version") if isinstance(body, dict) else None
        if not isinstance(version, str) or not version:
            raise OpenAIError.of(400, 'version: expected {"version": "VERSION"}', param="version")
        return _set_weights(frontend, name, {version: 1.0}, "version")

    return promote


def _set_weights(
    frontend: Frontend, name: str, weights: dict[str, float], param: str
) -> JSONResponse:
    try:
        versions = frontend.router.set_weights(name, weights)
    except KeyError:
        raise OpenAIError.of(
            404,
            f"The model `{name}` does not exist. Served LLMs: "
            f"{', '.join(frontend.router.by_name)}.",
            param="name",
            code="model_not_found",
        ) from None
    except ValueError as exc:
        raise OpenAIError.of(400, str(exc), param=param) from None
    return JSONResponse(
        {"model": name, "versions": [describe_model(frontend, d) for d in versions]}
    )


def _version_route(frontend: Frontend, model_path: str) -> Callable[[Request], Any]:
    async def version(request: Request) -> JSONResponse:
        """Versions and settings (needs a key when keys are on; no filesystem paths)."""
        frontend.auth.authenticate(request.headers)
        first = frontend.deployments[0]
        info = first.shared.info()
        model = {
            "name": first.pipeline.model_name,
            "path": Path(model_path).name,  # the checkpoint folder's name, not where it lives
            "max_model_len": first.pipeline.max_model_len,
            **info.get("model", {}),
        }
        return JSONResponse(
            {
                "inferflow": inferflow.__version__,
                "model": model,
                "engine": info.get("engine"),  # null until the worker has loaded it
                "models": [_model_versions(frontend, d) for d in frontend.deployments],
                "runtime": runtime_versions(),
                "supported_architectures": list(SUPPORTED_ARCHITECTURES),
            }
        )

    return version


def _model_versions(frontend: Frontend, deployment: Deployment) -> JSONObject:
    """One LLM version with its engine's versions (once loaded) for ``/version``."""
    info = deployment.shared.info()
    return {
        **describe_model(frontend, deployment),
        "path": Path(deployment.model_path).name,
        "max_model_len": deployment.pipeline.max_model_len,
        "model": info.get("model"),
        "engine": info.get("engine"),
    }


def _admin_stats_route(frontend: Frontend) -> Callable[[Request], Any]:
    async def admin_stats(request: Request) -> JSONResponse:
        """Running/waiting requests, free slots and KV blocks, cancellation counters."""
        frontend.auth.authorize_admin(request.headers)
        first = frontend.deployments[0]
        engine = first.shared.stats()
        return JSONResponse(
            {
                "status": readiness(frontend),
                "in_flight": sum(d.shared.in_flight for d in frontend.deployments),
                "api_process": {
                    "consumer_id": frontend.consumer_id,
                    "open_requests": len(frontend.registry),
                },
                "engine": {
                    **_ints(engine),
                    "executor": first.shared.executor_stats(),
                },
                "models": {
                    d.model_id: {
                        **describe_model(frontend, d),
                        "in_flight": d.shared.in_flight,
                        **_ints(d.shared.stats()),
                    }
                    for d in frontend.deployments
                },
                "embeddings": (
                    frontend.embeddings.models.stats() if frontend.embeddings is not None else {}
                ),
            }
        )

    return admin_stats


def _ints(stats: dict[str, float]) -> JSONObject:
    return {k: int(v) if float(v).is_integer() else v for k, v in stats.items()}
