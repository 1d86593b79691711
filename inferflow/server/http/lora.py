"""LoRA adapters on the HTTP side: vLLM's runtime routes and the adapters' metrics.

- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}``, in vLLM's shapes: 200 with a short text on
  success; 400 naming the field for a missing field, a name that is already served (a model or an
  adapter) or an adapter the engine cannot serve (``LoraError``'s field); 404 for unloading an
  adapter nobody serves. Registered only when a served LLM sets ``lora.allow_runtime_updates``
  (else the paths are unknown routes: a 404), and guarded like ``/admin/*``
  (``ApiKeyAuth.authorize_admin``: an admin key once keys are on; an API key is a 403).
  With several LLMs that allow updates, ``"model"`` names the base model to load into.
- The API process forwards ``LoadLora``/``UnloadLora`` to the model's engine worker, which
  applies it between two steps and answers like a request (``server/messages.py``); the route
  waits ``LORA_CONTROL_TIMEOUT_S`` at most (504 past it: the worker may still finish the load).
  The worker then republishes its adapters (``SharedState.lora``), which every API process
  routes by: no API process keeps its own list.
- ``lora_metrics``: vLLM's ``vllm:lora_requests_info`` gauge (labels ``running_lora_adapters``,
  ``waiting_lora_adapters``, ``max_lora``; value: when the worker last published) and the
  adapter load/unload counters, read from shared memory when ``/metrics`` is scraped.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

from inferflow.server.http.deployments import Deployment, _label
from inferflow.server.http.errors import OpenAIError, field_name
from inferflow.server.http.json_body import read_json_body
from inferflow.server.messages import LoadLora, LoraControl, UnloadLora

if TYPE_CHECKING:
    from inferflow.server.http.frontend import Frontend

LOAD_LORA_PATH = "/v1/load_lora_adapter"
UNLOAD_LORA_PATH = "/v1/unload_lora_adapter"
LORA_CONTROL_TIMEOUT_S = 120.0  # a load reads and checks the adapter's weights from disk


def runtime_deployments(frontend: Frontend) -> list[Deployment]:
    """The LLMs whose adapters may be loaded and unloaded at run time."""
    return [d for d in frontend.deployments if d.lora is not None and d.lora.allow_runtime_updates]


def lora_routes(frontend: Frontend) -> list[tuple[str, Callable[..., Any], list[str]]]:
    """The runtime adapter routes, [] unless a served LLM allows runtime updates."""
    if not runtime_deployments(frontend):
        return []

    async def load_lora_adapter(request: Request) -> Response:
        """Load a PEFT adapter folder under a new name (vLLM's ``/v1/load_lora_adapter``)."""
        frontend.auth.authorize_admin(request.headers)
        frontend.check_accepting()
        body = await _object(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        for key, value in (("lora_name", name), ("lora_path", path)):
            if not isinstance(value, str) or not value:
                raise OpenAIError.of(
                    400, "Both 'lora_name' and 'lora_path' must be provided.", param=key
                )
        assert isinstance(name, str) and isinstance(path, str)
        _check_new_name(frontend, name)
        deployment = _target(frontend, body.get("model"))
        text = await _control(
            frontend, deployment, lambda rid: LoadLora(rid, frontend.consumer_id, name, path)
        )
        return PlainTextResponse(text)

    async def unload_lora_adapter(request: Request) -> Response:
        """Stop serving an adapter (vLLM's ``/v1/unload_lora_adapter``): new requests for it
        are a 404 at once; requests already running finish."""
        frontend.auth.authorize_admin(request.headers)
        frontend.check_accepting()
        body = await _object(request)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise OpenAIError.of(
                400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                param="lora_name",
            )
        deployment = frontend.router.route_adapter(name)
        if deployment is None:
            raise OpenAIError.of(
                404, f"The lora adapter '{field_name(name)}' cannot be found.",
                param="lora_name", code="lora_not_found",
            )
        if deployment not in runtime_deployments(frontend):
            raise OpenAIError.of(
                400, f"lora_name: the adapters of `{deployment.model_id}` cannot change at run "
                "time (its lora.allow_runtime_updates is false)", param="lora_name",
            )
        text = await _control(
            frontend, deployment, lambda rid: UnloadLora(rid, frontend.consumer_id, name)
        )
        return PlainTextResponse(text)

    return [
        (LOAD_LORA_PATH, load_lora_adapter, ["POST"]),
        (UNLOAD_LORA_PATH, unload_lora_adapter, ["POST"]),
    ]


async def _object(request: Request) -> dict[str, Any]:
    body = await read_json_body(request)
    if not isinstance(body, dict):
        raise OpenAIError.of(400, "expected a JSON object", param=None)
    return body


def _check_new_name(frontend: Frontend, name: str) -> None:
    """400 when ``name`` already names a served model or adapter."""
    models = set(frontend.router.model_ids())
    if frontend.embeddings is not None:
        models.update(card["id"] for card in frontend.embeddings.models.cards(0))
    if name in models:
        raise OpenAIError.of(
            400, f"lora_name: `{field_name(name)}` is the name of a served model; an adapter "
            "needs a name of its own", param="lora_name",
        )
    if frontend.router.route_adapter(name) is not None:
        raise OpenAIError.of(
            400, f"The lora adapter '{field_name(name)}' has already been loaded.",
            param="lora_name",
        )


def _target(frontend: Frontend, model: object) -> Deployment:
    """The LLM to load into: the one that allows runtime updates, or the one ``model`` names."""
    runtime = runtime_deployments(frontend)
    if model is None:
        if len(runtime) == 1:
            return runtime[0]
        raise OpenAIError.of(
            400, "model: several models take adapters at run time "
            f"({', '.join(d.model_id for d in runtime)}); name the base model", param="model",
        )
    chosen = frontend.router.route(model) if isinstance(model, str) else None
    if chosen is None or chosen not in runtime:
        raise OpenAIError.of(
            400, f"model: expected one of {', '.join(d.model_id for d in runtime)} (the models "
            "with lora.allow_runtime_updates)", param="model",
        )
    return chosen


async def _control(
    frontend: Frontend, deployment: Deployment, make: Callable[[str], LoraControl]
) -> str:
    """Send one control message to ``deployment``'s worker and wait for its answer (its text;
    the worker's error as an ``OpenAIError``). An on-demand model that is not loaded loads
    first, as for a request (bounded by ``server.model_load_timeout_s``; 503 past it)."""
    await frontend.wait_loaded(deployment, None)
    request_id = f"lora-{uuid.uuid4().hex}"
    channel = frontend.registry.open(request_id, deployment.key)
    try:
        try:
            deployment.request_queue.put(make(request_id))
        except Exception:
            raise OpenAIError.of(
                503, "The engine worker is unavailable.", code="not_ready"
            ) from None
        try:
            update = await channel.next(LORA_CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise OpenAIError.of(
                504, f"the engine worker did not answer within {LORA_CONTROL_TIMEOUT_S:g} s",
                code="timeout",
            ) from None
    finally:
        frontend.registry.close(request_id)
    if update.error is not None:
        raise OpenAIError(update.error)
    return update.text


def lora_metrics(deployments: list[Deployment]) -> bytes:
    """Prometheus text of the adapters of every LLM with LoRA (b"" with none), from shared
    memory: every API process answers the same."""
    served = [d for d in deployments if d.lora is not None]
    if not served:
        return b""
    info = ["# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge"]
    loads = ["# HELP inferflow:lora_loads_total Adapters read from disk (at start, runtime "
             "loads, re-reads after host-memory eviction).",
             "# TYPE inferflow:lora_loads_total counter"]
    unloads = ["# HELP inferflow:lora_unloads_total Adapters unloaded at run time.",
               "# TYPE inferflow:lora_unloads_total counter"]
    slots = ["# HELP inferflow:lora_slot_loads_total Adapters written into an engine LoRA slot.",
             "# TYPE inferflow:lora_slot_loads_total counter"]
    for d in served:
        assert d.lora is not None
        state = d.shared.lora()
        model = f'model_name="{_label(d.name if not d.key else d.model_id)}"'
        labels = (
            f'{model},max_lora="{int(state.get("max_loras", d.lora.max_loras))}",'
            f'running_lora_adapters="{_label(",".join(state.get("running", ())))}",'
            f'waiting_lora_adapters="{_label(",".join(state.get("waiting", ())))}"'
        )
        info.append(f"vllm:lora_requests_info{{{labels}}} {float(state.get('updated_at', 0.0))}")
        loads.append(f"inferflow:lora_loads_total{{{model}}} {float(state.get('loads', 0))}")
        unloads.append(f"inferflow:lora_unloads_total{{{model}}} {float(state.get('unloads', 0))}")
        slots.append(f"inferflow:lora_slot_loads_total{{{model}}} "
                     f"{float(state.get('slot_loads', 0))}")
    return ("\n".join(info + loads + unloads + slots) + "\n").encode()

