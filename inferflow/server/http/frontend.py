"""The OpenAI routes' request path inside an API process.

Checks run cheapest first, each failing with OpenAI's error shape::

    413 body too large (middleware) -> 401 API key -> 503 not ready / draining
    -> 400 JSON and schema -> 404 unknown model
    -> 429 waiting queue full -> 429 requests/min -> request stages (validator, tokenizer,
    plugins; 400 naming the field) -> 429 tokens/min -> submit to the engine worker

A request refused with a 429 is charged nothing: the queue check comes before the rate
buckets, and a tokens-per-minute refusal gives its request token back.

A submitted request is a ``RequestFlow``; whatever ends it (last token, error, client hang-up,
timeout, shutdown) goes through ``finish``, which releases its admission slot, ends its span and,
unless the worker already finished it, sends the worker a ``CancelRequest`` that frees its slot.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from inferflow.server.http.channels import ChannelRegistry
from inferflow.server.http.errors import ErrorInfo, OpenAIError
from inferflow.server.http.json_body import read_json_body
from inferflow.server.http.limits import ApiKeyAuth, RateLimiter
from inferflow.server.http.pipeline import PreparedRequest, RequestPipeline
from inferflow.server.http.protocol import ChatCompletionRequest, CompletionRequest, parse_body
from inferflow.server.http.request_flow import RequestFlow
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.http.responses import ChatFormatter, CompletionFormatter, ResponseFormatter
from inferflow.server.http.settings import ServerSettings
from inferflow.server.http.sse import SSEResponse
from inferflow.server.http.tool_calls import ToolCallFormatter
from inferflow.server.messages import CancelRequest, SubmitRequest, WorkerLost
from inferflow.server.observability import FrontendTelemetry
from inferflow.server.process.shared_state import SharedState

logger = logging.getLogger(__name__)

_ROUTES: dict[
    str, tuple[type[CompletionRequest | ChatCompletionRequest], type[ResponseFormatter], str]
] = {
    # route: (schema, formatter, GenAI operation name)
    "completions": (CompletionRequest, CompletionFormatter, "text_completion"),
    "chat": (ChatCompletionRequest, ChatFormatter, "chat"),
}


class Frontend:
    """Handles ``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``."""

    def __init__(
        self,
        pipeline: RequestPipeline,
        settings: ServerSettings,
        shared: SharedState,
        telemetry: FrontendTelemetry | None = None,
        responses: ResponsePipeline | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.responses = responses or ResponsePipeline([])
        self.settings = settings
        self.shared = shared
        self.telemetry = telemetry or FrontendTelemetry(None)
        self.auth = ApiKeyAuth(settings.api_keys)
        self.limiter = RateLimiter(  # shared by the API processes forked after this
            settings.rate_limit_requests_per_minute,
            settings.rate_limit_tokens_per_minute,
            self.auth.key_ids,
        )
        self.registry = ChannelRegistry(on_worker_lost=self._worker_lost)
        self.consumer_id = 0  # this process's response queue; set before the API process forks
        self.request_queue: Any = None  # LitServe's request queue (a Manager proxy)
        self.draining = False
        self.created = int(time.time())
        # EmbeddingsFrontend of the extra embedding models (``extra_models``), if any
        self.embeddings: Any = None

    def is_draining(self) -> bool:
        return self.draining or self.shared.draining

    # --- routes -------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, "chat")

    def served_model_ids(self) -> list[str]:
        """The LLM's id, then every embedding model id and ``name@version``."""
        ids = [self.pipeline.model_name]
        if self.embeddings is not None:
            ids += [card["id"] for card in self.embeddings.models.cards(self.created)]
        return ids

    async def models(self, request: Request) -> Response:
        self.auth.authenticate(request.headers)
        card = {
            "id": self.pipeline.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "inferflow",
            "max_model_len": self.pipeline.max_model_len,
        }
        cards = [card]
        if self.embeddings is not None:
            cards += self.embeddings.models.cards(self.created)
        return JSONResponse({"object": "list", "data": cards})

    # --- admission ----------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.draining or self.shared.draining:
            raise OpenAIError.of(503, "The server is shutting down.", code="shutting_down")
        if not self.shared.ready:
            raise OpenAIError.of(
                503,
                "The model is not ready yet (loading or restarting).",
                code="not_ready",
                retry_after_s=1,
            )

    def _admit(self) -> None:
        """Count the request in flight unless the engine's slots and waiting queue are full."""
        waiting = self.settings.max_waiting_requests
        limit = None if waiting is None else int(self.shared.stats()["total_slots"]) + waiting
        if not self.shared.try_admit(limit):
            raise OpenAIError(
                ErrorInfo(
                    429,
                    "The server is at capacity: its waiting queue is full. Retry later.",
                    code="queue_full",
                    retry_after_s=1,
                )
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
        if body.model != self.pipeline.model_name:
            if self.embeddings is not None and self.embeddings.models.serves(body.model):
                from inferflow.embeddings.models import unsupported_route

                raise unsupported_route(body.model, request.url.path)
            raise OpenAIError.of(
                404,
                f"The model `{body.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        self._admit()  # the waiting-queue bound first: a burst's 429 costs no stage work
        try:
            prepared, span = await self._prepare(body, key_id, operation, request)
        except BaseException:  # a refusal, a stage error or a client that left
            self.shared.release()
            raise
        want_logprobs = prepared.params.logprobs is not None
        mode = body.tool_mode() if isinstance(body, ChatCompletionRequest) else None
        if mode is not None:
            assert isinstance(body, ChatCompletionRequest)
            formatter: ResponseFormatter = ToolCallFormatter(
                self.pipeline.model_name, body.include_usage, want_logprobs, mode, body.tool_names()
            )
        else:
            formatter = formatter_cls(self.pipeline.model_name, body.include_usage, want_logprobs)
        flow = self._submit(prepared, formatter, operation, request.url.path, started, span)
        if body.stream:
            flow.stream = True
            return SSEResponse(flow.events(), on_close=lambda gone: self.finish(flow, gone))
        try:
            return await flow.respond(request)
        finally:
            await self.finish(flow, client_gone=False)

    async def _prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        key_id: str,
        operation: str,
        request: Request,
    ) -> tuple[PreparedRequest, Any]:
        """Rate limits and the request stages; a request refused with a 429 is charged nothing
        (its request-per-minute token is given back when the token limit refuses it)."""
        self.limiter.check_request(key_id)
        span = self.telemetry.start_request(operation, body.model, request.headers, body)
        try:
            prepared = await self.pipeline.prepare(
                body, key_id, span.trace_context if span is not None else {}
            )
            self.limiter.check_tokens(key_id, prepared.reserved_tokens)
        except OpenAIError as exc:
            if exc.info.status_code == 429:
                self.limiter.refund_request(key_id)
            _end_failed_span(span, exc.info)
            raise
        except Exception:
            _end_failed_span(span, ErrorInfo(500, "internal server error", code="internal_error"))
            raise
        return prepared, span

    def _submit(
        self,
        prepared: PreparedRequest,
        formatter: Any,
        operation: str,
        route: str,
        started: float,
        span: Any,
    ) -> RequestFlow:
        timeout = self.settings.request_timeout_s
        deadline = prepared.arrival_time + timeout if timeout else None
        request_id = f"req-{uuid.uuid4().hex}"
        flow = RequestFlow(
            request_id, self.registry.open(request_id), formatter, deadline, route, started, span
        )
        flow.responses = self.responses.open(prepared.request)
        message = SubmitRequest(
            request_id=request_id,
            consumer_id=self.consumer_id,
            prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params,
            arrival_time=prepared.arrival_time,
            deadline=deadline,
            priority=prepared.priority,
            trace_context=prepared.trace_context,
            operation=operation,
        )
        try:
            self.request_queue.put(message)
        except Exception as exc:
            self.registry.close(request_id)
            self.shared.release()
            info = ErrorInfo(503, "The engine worker is unavailable.", code="not_ready")
            _end_failed_span(span, info)
            logger.error("cannot reach the engine worker's queue: %s", exc)
            raise OpenAIError(info) from None
        return flow

    async def finish(self, flow: RequestFlow, client_gone: bool) -> None:
        """Release the request; cancel it in the worker unless the worker already ended it."""
        self.registry.close(flow.request_id)
        self.shared.release()
        if client_gone and flow.error is None:
            flow.error = ErrorInfo(499, "the client closed the connection", code="client_closed")
        status = flow.error.status_code if flow.error is not None else 200
        flow.end_span(status)
        if flow.stream:
            self.telemetry.on_response(flow.route, status, time.time() - flow.started)
        if flow.channel.worker_done:
            return
        reason = "client_disconnected" if client_gone else "abandoned"
        try:
            self.request_queue.put(CancelRequest(flow.request_id, reason))
        except Exception as exc:  # the worker/Manager is gone; nothing left to free
            logger.debug("cancel of %s not delivered: %s", flow.request_id, exc)

    # --- worker loss and shutdown -------------------------------------------------------------
    def _worker_lost(self, notice: WorkerLost) -> None:
        if notice.request_queue is not None:
            self.request_queue = notice.request_queue
        failed = self.fail_all(notice.error)
        logger.error("engine worker lost; failed %d in-flight request(s)", failed)

    def fail_all(self, error: ErrorInfo) -> int:
        """Fail every in-flight request of this process (shutdown after the grace period)."""
        return len(self.registry.fail_all(error))


def _end_failed_span(span: Any, error: ErrorInfo) -> None:
    if span is not None:
        span.set_http_status(error.status_code)
        span.record_error(error.message, error.code or error.error_type)
        span.end()
