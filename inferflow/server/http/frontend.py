"""The OpenAI routes' request path inside an API process.

Checks run cheapest first, each failing with OpenAI's error shape::

    413 body too large (middleware) -> 401 API key -> 503 not ready / draining
    -> 400 JSON and schema (and prompts x n over ``max_choices_per_request``)
    -> 404 unknown model (naming the served ones)
    -> 503 model failed to load / restarting -> 429 waiting queue full -> 429 requests/min
    -> request stages (validator, tokenizer, plugins; 400 naming the field) -> 429 tokens/min
    -> wait for an on-demand model to load (``model_load`` span; 503 past the load timeout)
    -> submit to that model's engine worker

The model is a ``Deployment`` (``deployments.py``): one LLM version with its own request
stages, engine worker queue and shared state; ``DeploymentRouter`` picks it from ``model``.
A ``model`` that names a LoRA adapter goes to the version serving it, with ``lora=ADAPTER`` on
the engine request (``SubmitRequest.lora``), the root span (``inferflow.lora.name``; its
``gen_ai.request.model`` stays what the client sent) and the stages' ``attributes["lora"]``;
responses name the adapter as their ``model``, as vLLM's do.

A completion request of k prompts x ``n`` choices is k*n engine requests (``choices.py``): it takes
k*n admission slots and request tokens, and the tokens of all of them.

A request refused with a 429 is charged nothing: the queue check comes before the rate
buckets, and a tokens-per-minute refusal gives its request token back.

A submitted request is a ``RequestFlow``; whatever ends it (last token, error, client hang-up,
timeout, shutdown) goes through ``finish``, which releases its admission slots, ends its span and,
for each engine request the worker has not finished, sends a ``CancelRequest`` that frees it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferflow.config import LoadMode
from inferflow.config.server import ServerConfig
from inferflow.server.http.channels import ChannelRegistry
from inferflow.server.http.choices import count_choices, plan_choices, prompt_info, set_prompt
from inferflow.server.http.deployments import (
    Deployment,
    DeploymentRouter,
    LoadRequests,
    load_failed,
    wait_until_serving,
)
from inferflow.server.http.embeddings import EmbeddingModels, EmbeddingsFrontend, unsupported_route
from inferflow.server.http.errors import CLIENT_CLOSED, OpenAIError
from inferflow.server.http.json_body import read_json_body
from inferflow.server.http.limits import ApiKeyAuth, RateLimiter
from inferflow.server.http.pipeline import PreparedRequest
from inferflow.server.http.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from inferflow.server.http.request_flow import ChoiceFlow, RequestFlow
from inferflow.server.http.responses import ChatFormatter, CompletionFormatter, ResponseFormatter
from inferflow.server.http.sse import SSEResponse
from inferflow.server.http.tool_calls import chat_formatter
from inferflow.server.messages import CancelRequest, ErrorInfo, SubmitRequest, WorkerLost
from inferflow.server.observability import FrontendTelemetry
from inferflow.server.shared_state import SharedState
from inferflow.telemetry.attributes import LORA_NAME

if TYPE_CHECKING:
    from inferflow.embeddings.models import EmbeddingModelSpec
    from inferflow.telemetry.spans import RequestSpan

logger = logging.getLogger(__name__)

VERSION_HEADER = "x-inferflow-model-version"  # which version of the model answered
ROUTE_KEY_HEADER = "x-inferflow-route-key"  # sticky canary key (else the body's ``user``)
COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
MODELS_PATH = "/v1/models"

_ROUTES: dict[
    str, tuple[type[CompletionRequest | ChatCompletionRequest], type[ResponseFormatter], str]
] = {
    # route: (schema, formatter, GenAI operation name)
    "completions": (CompletionRequest, CompletionFormatter, "text_completion"),
    "chat": (ChatCompletionRequest, ChatFormatter, "chat"),
}


class Frontend:
    """Handles ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``.

    ``shared`` is the server's state (draining, queue lost). ``deployments`` are the served LLM
    versions, each with its own ``SharedState`` and request queue.
    """

    def __init__(
        self,
        deployments: list[Deployment],
        settings: ServerConfig,
        shared: SharedState,
        telemetry: FrontendTelemetry | None = None,
    ) -> None:
        self.deployments = deployments
        self.router = DeploymentRouter(deployments)
        self.load_requests = LoadRequests()  # the supervisor's wake-up pipe, set before forking
        self.settings = settings
        self.shared = shared
        self.telemetry = telemetry or FrontendTelemetry(None)
        self.auth = ApiKeyAuth.for_server(settings)
        self.limiter = RateLimiter(  # shared by the API processes forked after this
            settings.rate_limit_requests_per_minute,
            settings.rate_limit_tokens_per_minute,
            self.auth.key_ids,
        )
        self.registry = ChannelRegistry(on_worker_lost=self._worker_lost)
        self.consumer_id = 0  # this process's response queue; set before the API process forks
        self.draining = False
        self.created = int(time.time())
        # EmbeddingsFrontend of the extra embedding models (``extra_models``), if any
        self.embeddings: EmbeddingsFrontend | None = None

    def serve_embeddings(self, specs: list[EmbeddingModelSpec]) -> None:
        """Serve the ``extra_models`` encoders ``specs`` (if any) beside the LLMs, sharing this
        frontend's keys, rate limits, draining and telemetry."""
        if not specs:
            return
        self.embeddings = EmbeddingsFrontend(
            EmbeddingModels(specs),
            self.auth,
            self.is_draining,
            on_response=self.telemetry.on_response,
            tracer=lambda: self.telemetry.tracer,
            limiter=self.limiter,
        )

    def deployment(self, key: str) -> Deployment | None:
        return next((d for d in self.deployments if d.key == key), None)

    def is_draining(self) -> bool:
        return self.draining or self.shared.draining

    # --- routes -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    def _cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: the LLMs (names, then ``name@version`` when a name has several
        versions), their LoRA adapters, then every embedding model id and ``name@version``."""
        cards = self.router.cards(self.created) + self.router.adapter_cards(self.created)
        if self.embeddings is not None:
            cards += self.embeddings.models.cards(self.created)
        return cards

    def served_model_ids(self) -> list[str]:
        return [card["id"] for card in self._cards()]

    async def models(self, request: Request) -> Response:
        self.auth.authenticate(request.headers)
        return JSONResponse({"object": "list", "data": self._cards()})

    # --- admission ----------------------------------------------------------------------------
    def check_accepting(self, deployment: Deployment | None = None) -> None:
        if self.is_draining():
            raise OpenAIError.of(503, "The server is shutting down.", code="shutting_down")
        if deployment is None:
            return
        if (failed := load_failed(deployment)) is not None:
            raise failed
        if deployment.load is LoadMode.eager and not deployment.serving:
            raise OpenAIError.of(
                503,
                "The model is not ready yet (loading or restarting).",
                code="not_ready",
                retry_after_s=1,
            )

    def _unknown_model(self, model: str) -> OpenAIError:
        known = ", ".join(self.served_model_ids())
        return OpenAIError.of(
            404,
            f"The model `{model}` does not exist. Served models: {known}.",
            param="model",
            code="model_not_found",
        )

    def route(self, model: str, request: Request, user: str | None = None) -> Deployment:
        """The LLM version that serves ``model`` for this request (a canary split sticks to the
        route-key header, else ``user``; a LoRA adapter: the version serving it); 404 naming
        the served models, or 400 for an embedding model."""
        return self.resolve(model, request, user)[0]

    def resolve(
        self, model: str, request: Request, user: str | None = None
    ) -> tuple[Deployment, str | None]:
        """``route`` and the LoRA adapter ``model`` names (None: a model, not an adapter)."""
        deployment = self.router.route(model, request.headers.get(ROUTE_KEY_HEADER) or user)
        if deployment is not None:
            return deployment, None
        deployment = self.router.route_adapter(model)
        if deployment is not None:
            return deployment, model
        if self.embeddings is not None and self.embeddings.models.serves(model):
            raise unsupported_route(model, request.url.path)
        raise self._unknown_model(model)

    async def wait_loaded(self, deployment: Deployment, span: RequestSpan | None) -> None:
        """Until ``deployment`` serves (an on-demand model loads on its first request), with a
        ``model_load`` span for the wait; 503 when it fails, the server drains or
        ``model_load_timeout_s`` passes."""
        if deployment.serving:
            return
        started = time.time()
        outcome = "abandoned"  # e.g. the client left while it waited
        try:
            outcome = await wait_until_serving(
                deployment, self.settings.model_load_timeout_s, self.is_draining,
                self.load_requests,
            )
        except OpenAIError as exc:
            outcome = exc.info.code or "error"
            raise
        finally:
            self.telemetry.model_load(span, deployment.model_id, started, time.time(), outcome)

    def _admit(self, deployment: Deployment, count: int) -> None:
        """Count the request's ``count`` engine requests in flight unless the model's slots and
        waiting queue would overflow."""
        shared = deployment.shared
        waiting = self.settings.max_waiting_requests
        slots = int(shared.stats()["total_slots"]) or deployment.slots_hint  # (before its load)
        limit = None if waiting is None else slots + waiting
        if not shared.try_admit(limit, count):
            raise OpenAIError.of(
                429,
                "The server is at capacity: its waiting queue is full. Retry later.",
                code="queue_full",
                retry_after_s=1,
            )

    # --- request path -------------------------------------------------------------------------
    async def _serve(self, request: Request, route: str) -> Response:
        """Checks, stages and submission; HTTP metrics for every outcome but a live stream."""
        started = time.time()
        status, streaming = 500, False
        try:
            response = await self._handle(request, route, started)
            status, streaming = response.status_code, isinstance(response, SSEResponse)
            return response
        except OpenAIError as exc:
            status = exc.info.status_code
            raise
        finally:
            if not streaming:  # a stream is counted when it ends (finish)
                self.telemetry.on_response(request.url.path, status, time.time() - started)

    async def _handle(self, request: Request, route: str, started: float) -> Response:
        schema, formatter_cls, operation = _ROUTES[route]
        key_id = self.auth.authenticate(request.headers)
        self.check_accepting()
        body = parse_body(schema, await read_json_body(request))
        count = count_choices(body, self.settings.max_choices_per_request)
        deployment, lora = self.resolve(body.model, request, body.user)
        self.check_accepting(deployment)
        # the waiting-queue bound first: a burst's 429 costs no stage work
        self._admit(deployment, count)
        deployment.shared.touch()
        try:
            prepared, span = await self._prepare(
                body, key_id, operation, request, deployment, count, lora
            )
        except BaseException:  # a refusal, a stage error or a client that left
            deployment.shared.release(count)
            raise
        try:
            await self.wait_loaded(deployment, span)
        except BaseException as exc:  # failed to load, timed out, or the client left
            deployment.shared.release(count)
            _end_failed_span(span, exc.info if isinstance(exc, OpenAIError) else CLIENT_CLOSED)
            raise
        want_logprobs = prepared[0].params.logprobs is not None
        served = lora or deployment.name  # the responses' ``model``

        def formatter() -> ResponseFormatter:
            if isinstance(body, ChatCompletionRequest):
                pipeline = deployment.pipeline
                return chat_formatter(
                    served, body.include_usage, want_logprobs, body.tool_mode(),
                    body.tool_names(), pipeline.tool_parser, pipeline.reasoning_parser,
                    prepared[0].prompt_token_ids,
                )
            return formatter_cls(served, body.include_usage, want_logprobs)

        flow = self._submit(
            body, prepared, formatter, operation, request.url.path, started, span, deployment,
            lora,
        )
        headers = {VERSION_HEADER: deployment.version}
        if body.stream:
            flow.stream = True
            return SSEResponse(
                flow.events(), on_close=lambda gone: self.finish(flow, gone), headers=headers
            )
        try:
            response = await flow.respond(request)
            response.headers.update(headers)
            return response
        finally:
            await self.finish(flow, client_gone=False)

    async def _prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        key_id: str,
        operation: str,
        request: Request,
        deployment: Deployment,
        count: int,
        lora: str | None = None,
    ) -> tuple[list[PreparedRequest], RequestSpan | None]:
        """Rate limits (``count`` engine requests) and the model's request stages, once per
        prompt; a request refused with a 429 is charged nothing (its request-per-minute tokens
        are given back when the token limit refuses it). ``lora``: the adapter it runs with."""
        self.limiter.check_request(key_id, count)
        span = self.telemetry.start_request(operation, body.model, request.headers, body)
        if span is not None:
            span.set_attributes({
                "inferflow.model.id": deployment.model_id,
                "inferflow.model.version": deployment.version,
                **({LORA_NAME: lora} if lora is not None else {}),
            })
        prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
        trace = span.trace_context if span is not None else {}
        try:
            prepared = [
                await deployment.pipeline.prepare(body, key_id, trace, i, lora)
                for i in range(prompts)
            ]
            sequences = body.num_sequences
            self.limiter.check_tokens(key_id, sum(p.reserved_tokens for p in prepared) * sequences)
        except OpenAIError as exc:
            if exc.info.status_code == 429:
                self.limiter.refund_request(key_id, count)
            _end_failed_span(span, exc.info)
            raise
        except Exception:
            _end_failed_span(span, ErrorInfo(500, "internal server error", code="internal_error"))
            raise
        return prepared, span

    def _submit(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        prepared: list[PreparedRequest],
        formatter: Callable[[], ResponseFormatter],
        operation: str,
        route: str,
        started: float,
        span: RequestSpan | None,
        deployment: Deployment,
        lora: str | None = None,
    ) -> RequestFlow:
        """One engine request per choice (``choices.py``), each with its own channel."""
        timeout = self.settings.request_timeout_s
        tokenizer = deployment.pipeline.tokenizer
        prompts = [prompt_info(body, i, p.prompt_token_ids, tokenizer)
                   for i, p in enumerate(prepared)]
        flow = RequestFlow([], route, started, span, n=body.n)
        flow.deployment = deployment
        first: ResponseFormatter | None = None
        leader_id = ""
        plan = plan_choices(body, prepared)
        for index, choice in enumerate(plan):
            prep = prepared[choice.prompt_index]
            deadline = prep.arrival_time + timeout if timeout else None
            request_id = f"req-{uuid.uuid4().hex}"
            leader_id = request_id if choice.leader else leader_id
            fmt = set_prompt(formatter(), body, prompts[choice.prompt_index])
            first = first or fmt
            flow.choices.append(ChoiceFlow(
                request_id,
                self.registry.open(request_id, deployment.key),
                fmt.sibling(first, index),
                deadline,
                choice.prompt_index,
                choice.leader,
                responses=deployment.responses.open(prep.request),
            ))
            message = SubmitRequest(
                request_id=request_id,
                consumer_id=self.consumer_id,
                prompt_token_ids=choice.prompt_token_ids,
                params=choice.params,
                arrival_time=prep.arrival_time,
                deadline=deadline,
                priority=prep.priority,
                trace_context=prep.trace_context,
                operation=operation,
                prompt_leader=None if choice.leader else leader_id,
                lora=lora,
            )
            try:
                deployment.request_queue.put(message)
            except Exception as exc:
                flow.choices[-1].channel.worker_done = True  # (never reached the worker)
                self._cancel(flow, "abandoned")
                for c in flow.choices:
                    self.registry.close(c.request_id)
                deployment.shared.release(len(plan))
                info = ErrorInfo(503, "The engine worker is unavailable.", code="not_ready")
                _end_failed_span(span, info)
                logger.error("cannot reach the engine worker's queue: %s", exc)
                raise OpenAIError(info) from None
        return flow

    async def finish(self, flow: RequestFlow, client_gone: bool) -> None:
        """Release the request; cancel it in the worker unless the worker already ended it."""
        deployment = flow.deployment
        assert deployment is not None
        for choice in flow.choices:
            self.registry.close(choice.request_id)
        deployment.shared.release(len(flow.choices))
        deployment.shared.touch()
        if client_gone and flow.error is None:
            flow.error = CLIENT_CLOSED
        status = flow.error.status_code if flow.error is not None else 200
        flow.end_span(status)
        if flow.stream:
            self.telemetry.on_response(flow.route, status, time.time() - flow.started)
        self._cancel(flow, "client_disconnected" if client_gone else "abandoned")

    def _cancel(self, flow: RequestFlow, reason: str) -> None:
        """Cancel, in the worker, each of ``flow``'s engine requests it has not finished."""
        assert flow.deployment is not None
        for choice in flow.choices:
            if choice.channel.worker_done:
                continue
            try:
                flow.deployment.request_queue.put(CancelRequest(choice.request_id, reason))
            except Exception as exc:  # the worker/Manager is gone; nothing left to free
                logger.debug("cancel of %s not delivered: %s", choice.request_id, exc)
                return

    # --- worker loss and shutdown -------------------------------------------------------------
    def _worker_lost(self, notice: WorkerLost) -> None:
        deployment = self.deployment(notice.deployment)
        if deployment is None:
            return
        if notice.request_queue is not None:
            deployment.request_queue = notice.request_queue
        failed = len(self.registry.fail_all(notice.error, deployment=notice.deployment))
        logger.error(
            "engine worker of %s lost; failed %d in-flight request(s)", deployment.model_id, failed
        )


def _end_failed_span(span: RequestSpan | None, error: ErrorInfo) -> None:
    if span is not None:
        span.set_http_status(error.status_code)
        span.record_error(error.message, error.code or error.error_type)
        span.end()
