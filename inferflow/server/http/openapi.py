"""The OpenAPI document (``/openapi.json``, ``/docs``): the API as it really is.

The handlers take the raw request and parse the body themselves (a 400 naming the field for any
bytes, see ``json_body`` and ``protocol``), so FastAPI cannot infer their request bodies. This
module describes every route by hand from the same pydantic models: request bodies
(``CompletionRequest``, ``ChatCompletionRequest``, ``EmbeddingRequest``), response bodies (the
models below mirror what ``responses.py`` and the embedding API write), content types
(``text/event-stream`` for streams, Prometheus text for ``/metrics``) and every error status a
route can answer, with OpenAI's error body and ``Retry-After`` where it is sent.

``tests/server/test_openapi_fuzz.py`` runs schemathesis against a live server with this document:
zero 5xx and zero responses that break it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

import inferflow
from inferflow.server.http.embeddings import EmbeddingRequest
from inferflow.server.http.protocol import ChatCompletionRequest, CompletionRequest
from inferflow.server.http.tokenization import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

FinishReason = Literal["stop", "length", "tool_calls"]


# --- response bodies ----------------------------------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every 4xx and 5xx."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = 0
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


# vLLM's ``prompt_logprobs``: None for the first prompt token, then per token
# ``{token_id: {"logprob", "rank", "decoded_token"}}`` (the token and its top alternatives)
PromptLogprobs = list[dict[str, dict[str, Any]] | None]


class CompletionChoice(BaseModel):
    index: int  # prompt_index * n + i
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None
    prompt_logprobs: PromptLogprobs | None = None  # only when the request asks for them


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only when the request asks for them


class ModelVersionCard(BaseModel):
    version: str
    weight: float  # its configured weight (the canary split)
    effective_weight: float | None = None  # LLMs: its share of unpinned requests now
    routable: bool | None = None  # LLMs: it may take unpinned requests (ready, or on demand)
    status: str


class ModelCard(BaseModel):
    id: str  # a name (its versions split by weight) or a pinned ``name@version``
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None = None
    versions: list[ModelVersionCard] | None = None  # LLMs
    task: str | None = None  # embedding models: "embed"
    root: str | None = None  # LoRA adapters: the adapter's folder
    parent: str | None = None  # LoRA adapters: the base model it runs on


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format=base64


class EmbeddingResponse(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: Usage


class Health(BaseModel):
    status: Literal["ok"]
    ready: bool


class ModelReadiness(BaseModel):
    id: str
    name: str
    version: str
    load: Literal["eager", "on_demand"]
    status: Literal["ready", "loading", "unloaded", "unloading", "failed", "not_ready", "stalled"]
    weight: float
    effective_weight: float  # its share of unpinned requests now (0 while it cannot serve)
    routable: bool  # it may take unpinned requests: ready, or on demand and not failed
    rss_bytes: int | None = None
    memory_bytes: int | None = None  # what server.model_memory_budget counts it for
    error: str | None = None  # why it failed to load


class Readiness(BaseModel):
    status: Literal["ready", "not_ready", "draining", "stalled"]
    models: list[ModelReadiness] = []
    embedding_models: dict[str, str] | None = None


class TrafficRequest(BaseModel):
    weights: dict[str, float]  # version -> share of unpinned traffic (others: 0)


class PromoteRequest(BaseModel):
    version: str  # all unpinned traffic to this version


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's body; ``model`` (inferflow) names the base model when several take adapters."""

    lora_name: str  # the name requests select it by (``model``); not a served model's
    lora_path: str  # a PEFT adapter folder on the server
    model: str | None = None


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str


# --- operations ---------------------------------------------------------------------------------
GENERATE_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503, 504)
EMBED_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)
TOKENIZE_ERRORS = (400, 401, 404, 408, 413, 503)
ERROR_TEXT = {
    400: "Malformed JSON, a schema or range error, an unsupported parameter, or a prompt over "
    "the context; `param` names the field",
    401: "Missing or wrong API key (when keys are configured)",
    403: "An API key on an admin route: it needs one of `server.admin_keys` (with `api_keys` "
    "and no `admin_keys`, the admin routes refuse every key)",
    404: "Unknown `model` (or LoRA adapter)",
    408: "The request body did not arrive in time",
    413: "The body exceeds `server.max_payload_bytes`",
    429: "Waiting queue full, or a rate limit reached",
    500: "The engine worker crashed or the engine failed",
    503: "Model loading, worker restarting, server draining or too many connections",
    504: "`server.request_timeout_s` exceeded",
}
RETRY_AFTER = {429, 503}
SSE_EVENT = {  # one server-sent event (a stream is a sequence of them)
    "type": "object",
    "description": "With `stream: true`, each event's `data` is one chunk (JSON, the object "
    "`*.chunk` / `text_completion`), then `[DONE]`; a failure after the 200 header is a "
    "`data: {\"error\": ...}` event (OpenAI's error body) before `[DONE]`",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


@dataclass(frozen=True)
class Operation:
    """How one route is described: its body model, its 200 and the errors it can answer."""

    summary: str
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    streams: bool = False  # 200 may also be text/event-stream (``"stream": true``)
    media_type: str = "application/json"
    errors: tuple[int, ...] = ()
    other: dict[int, type[BaseModel]] | None = None  # non-error statuses besides 200


OPERATIONS: dict[tuple[str, str], Operation] = {
    ("/v1/completions", "post"): Operation(
        "Text completion (OpenAI)",
        CompletionRequest,
        CompletionResponse,
        streams=True,
        errors=GENERATE_ERRORS,
    ),
    ("/v1/chat/completions", "post"): Operation(
        "Chat completion (OpenAI)",
        ChatCompletionRequest,
        ChatCompletionResponse,
        streams=True,
        errors=GENERATE_ERRORS,
    ),
    ("/v1/embeddings", "post"): Operation(
        "Embeddings (OpenAI)", EmbeddingRequest, EmbeddingResponse, errors=EMBED_ERRORS
    ),
    ("/v1/models", "get"): Operation("Served models", response=ModelList, errors=(401,)),
    ("/tokenize", "post"): Operation(
        "Prompt or conversation -> token ids (vLLM)",
        TokenizeRequest,
        TokenizeResponse,
        errors=TOKENIZE_ERRORS,
    ),
    ("/detokenize", "post"): Operation(
        "Token ids -> text (vLLM)", DetokenizeRequest, DetokenizeResponse, errors=TOKENIZE_ERRORS
    ),
    ("/health", "get"): Operation("Liveness: the API process answers", response=Health),
    ("/ready", "get"): Operation(
        "Readiness: the engine is loaded, warm and consuming requests",
        response=Readiness,
        other={503: Readiness},
    ),
    ("/version", "get"): Operation(
        "Versions of inferflow, the model and the runtime", errors=(401,)
    ),
    ("/metrics", "get"): Operation(
        "Prometheus metrics", media_type="text/plain; version=0.0.4", errors=(401,)
    ),
    ("/admin/stats", "get"): Operation("Engine and frontend counters", errors=(401, 403)),
    # (with lora.allow_runtime_updates; admin keys once keys are on)
    ("/v1/load_lora_adapter", "post"): Operation(
        "Load a LoRA adapter at run time (vLLM)",
        LoadLoraAdapterRequest,
        media_type="text/plain",
        errors=(400, 401, 403, 413, 503, 504),
    ),
    ("/v1/unload_lora_adapter", "post"): Operation(
        "Unload a LoRA adapter (vLLM): its running requests finish, new ones are a 404",
        UnloadLoraAdapterRequest,
        media_type="text/plain",
        errors=(400, 401, 403, 404, 413, 503, 504),
    ),
    ("/admin/models/{name}/traffic", "post"): Operation(
        "Set the canary split of an LLM's versions",
        TrafficRequest,
        errors=(400, 401, 403, 404, 413),
    ),
    ("/admin/models/{name}/promote", "post"): Operation(
        "Send all unpinned traffic of an LLM to one version",
        PromoteRequest,
        errors=(400, 401, 403, 404, 413),
    ),
}


def _is_hidden(path: str) -> bool:
    """LitServe's own routes (``/`` and ``/_litserve/...``) are not part of the API."""
    return path == "/" or path.startswith("/_litserve/")


def install_openapi(
    app: FastAPI, model_ids: Callable[[], list[str]] | None = None, description: str = ""
) -> None:
    """Make ``app.openapi()`` (what ``/openapi.json`` serves) describe the routes above;
    ``model_ids`` (called once, at the first request for the document): the served models,
    the only values of ``model`` not answered with 404."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            ids = model_ids() if model_ids is not None else []
            app.openapi_schema = build_openapi(app, ids, description)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_openapi(
    app: FastAPI, model_ids: list[str] | None = None, description: str = ""
) -> dict[str, Any]:
    schema = get_openapi(
        title="inferflow",
        version=inferflow.__version__,
        description=description or "OpenAI-compatible inference server",
        routes=app.routes,
    )
    paths: dict[str, Any] = schema.get("paths", {})
    for path in [p for p in paths if _is_hidden(p)]:
        del paths[path]
    components: dict[str, Any] = schema.setdefault("components", {}).setdefault("schemas", {})
    for (path, method), doc in OPERATIONS.items():
        operation = paths.get(path, {}).get(method)
        if operation is None:
            continue  # not served by this server (e.g. no embedding model)
        paths[path][method] = _describe(operation, doc, components)
    if model_ids:  # in request bodies: one of the served models (else 404)
        for name in (
            "CompletionRequest", "ChatCompletionRequest", "EmbeddingRequest",
            "TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest",
        ):
            properties = components.get(name, {}).get("properties", {})
            if "model" in properties:
                properties["model"] = {
                    "type": "string",
                    "enum": list(model_ids),
                    "description": "A model `GET /v1/models` lists; any other is a 404",
                }
    return schema


def _describe(operation: dict[str, Any], doc: Operation, components: dict[str, Any]) -> dict:
    operation = {k: v for k, v in operation.items() if k not in ("responses", "requestBody")}
    operation["summary"] = doc.summary
    if doc.request is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": _ref(doc.request, components)}},
        }
    if doc.response is not None:
        body: dict[str, Any] = _ref(doc.response, components)
    else:  # free-form JSON, or text
        body = {"type": "string"} if doc.media_type.startswith("text/") else {"type": "object"}
    ok: dict[str, Any] = {doc.media_type: {"schema": body}}
    if doc.streams:
        ok["text/event-stream"] = {"schema": SSE_EVENT}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": ok}}
    for status, model in (doc.other or {}).items():
        responses[str(status)] = {
            "description": "Not ready",
            "content": {"application/json": {"schema": _ref(model, components)}},
        }
    for status in doc.errors:
        response: dict[str, Any] = {
            "description": ERROR_TEXT[status],
            "content": {"application/json": {"schema": _ref(ErrorResponse, components)}},
        }
        if status in RETRY_AFTER:
            response["headers"] = {
                "Retry-After": {
                    "description": "Seconds to wait before retrying",
                    "schema": {"type": "integer"},
                    "required": False,
                }
            }
        responses[str(status)] = response
    operation["responses"] = responses
    return operation


def _ref(model: type[BaseModel], components: dict[str, Any]) -> dict[str, str]:
    """Add ``model`` (and the models it uses) to ``components``; a ``$ref`` to it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    for name, sub in schema.pop("$defs", {}).items():
        components.setdefault(name, sub)
    components.setdefault(model.__name__, schema)
    return {"$ref": f"#/components/schemas/{model.__name__}"}
