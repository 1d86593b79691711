"""Typed messages between the processes of a running server.

::

    API process --SubmitRequest/CancelRequest--> request queue (LitServe Manager) --> engine worker
    API process --LoadLora/UnloadLora--> request queue --> engine worker (between two steps)
    engine worker --UpdateBatch--> response queue of that API process (one per API process)
    supervisor (main process) --WorkerLost--> every API response queue
    supervisor --StopWorker--> request queue

A LoRA control message is answered like a request: the worker posts one final ``RequestUpdate``
under the message's ``request_id`` (``finish_reason="stop"`` and a short ``text`` on success,
``error`` otherwise) to the sender's response queue, so it travels, and fails on a lost worker,
the way request updates do.

Every queue put is a Manager round-trip, so the worker sends ONE ``UpdateBatch`` per API process
per flush, carrying the new text of every request that advanced; ``RequestUpdate.merge`` folds
several steps of one request into one update when the transport falls behind.

``ErrorInfo`` is the one error shape of every side: a plain picklable dataclass the worker sends
(a 504 timeout, a 500 engine failure) and the HTTP side renders (``http/errors.OpenAIError``).
What a client sent can be anything (a lone surrogate, a NUL, a 10 KB key), so it stores its
``message`` and ``param`` already safe: UTF-8 encodable and bounded (``safe_text``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from typing import Any

from inferflow.sampling_params import SamplingParams
from inferflow.telemetry.timings import RequestTimings

MAX_MESSAGE_CHARS = 4096  # an error message echoing a client's input stays this short
MAX_PARAM_CHARS = 256

# HTTP status -> OpenAI error ``type`` when the raiser does not name one (else server_error).
_DEFAULT_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def safe_text(text: str, limit: int) -> str:
    """``text`` encodable as UTF-8 (a lone surrogate becomes its ``\\udXXX`` escape) and at
    most ``limit`` characters (cut ones end in ``...``)."""
    text = str(text).encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: max(0, limit - 3)] + "..."


@dataclass(frozen=True)
class ErrorInfo:
    """One API error. ``param`` names the offending request field (400s), ``retry_after_s``
    becomes a ``Retry-After`` header (429/503)."""

    status_code: int
    message: str
    type: str = ""
    param: str | None = None
    code: str | None = None
    retry_after_s: float | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "message", safe_text(self.message, MAX_MESSAGE_CHARS))
        if self.param is not None:
            object.__setattr__(self, "param", safe_text(self.param, MAX_PARAM_CHARS))

    @property
    def error_type(self) -> str:
        return self.type or _DEFAULT_TYPES.get(self.status_code, "server_error")

    def body(self) -> dict[str, Any]:
        """The JSON object OpenAI clients parse (``openai.APIStatusError.body``)."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response_headers(self) -> dict[str, str]:
        headers = dict(self.headers)
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        return headers

    def sse_event(self) -> str:
        """The error as one Server-Sent Event (for a stream that fails after its 200 header)."""
        payload = self.body()
        payload["error"]["status_code"] = self.status_code
        return f"data: {json.dumps(payload)}\n\n"


# the queue (Manager) process died: in-flight requests fail with it (the API processes, and the
# worker once its request queue is gone), and the server exits for a supervisor to restart it
QUEUE_LOST = ErrorInfo(
    503,
    "The server lost its internal request queue (the queue process died) and is shutting "
    "down; retry once it is back.",
    code="queue_lost",
)


@dataclass(frozen=True)
class SubmitRequest:
    """A validated, tokenized request for the engine. Times are ``time.time()`` seconds."""

    request_id: str
    consumer_id: int  # response queue (API process) that receives this request's updates
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    deadline: float | None  # the worker aborts the request at this time and reports a 504
    priority: int = 0
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C carrier of the root span
    operation: str = "text_completion"  # GenAI operation name: text_completion | chat
    # n > 1 / best_of: the request id of the sibling choice whose prompt this one shares (same
    # prompt tokens, submitted first); the engine starts this one once the leader's prompt KV is
    # cached, so the prompt is computed once
    prompt_leader: str | None = None
    # the LoRA adapter (its served name) the request runs with; None: the base model
    lora: str | None = None


@dataclass(frozen=True)
class LoadLora:
    """Load the PEFT adapter at ``path`` under ``name`` (``POST /v1/load_lora_adapter``); the
    worker answers ``request_id`` on ``consumer_id``'s response queue."""

    request_id: str
    consumer_id: int
    name: str
    path: str


@dataclass(frozen=True)
class UnloadLora:
    """Stop serving adapter ``name`` (``POST /v1/unload_lora_adapter``): new requests for it are
    refused at once, running ones finish; answered like ``LoadLora``."""

    request_id: str
    consumer_id: int
    name: str


LoraControl = LoadLora | UnloadLora


@dataclass(frozen=True)
class CancelRequest:
    """Abort a request (client disconnected, frontend timeout, worker restart)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class StopWorker:
    """Fail whatever is still running with ``error`` and leave the engine loop."""

    error: ErrorInfo


WorkerInbound = SubmitRequest | CancelRequest | StopWorker | LoadLora | UnloadLora


@dataclass(frozen=True)
class LogprobEntry:
    """One generated token's logprob, with its decoded text and the top alternatives."""

    token: str
    token_id: int
    logprob: float
    top: tuple[tuple[str, int, float], ...] = ()  # (text, token_id, logprob), best first


@dataclass(frozen=True)
class RequestUpdate:
    """What one request gained since its previous update.

    ``text``/``logprobs`` are deltas; ``completion_tokens`` is cumulative. The request's last
    update carries ``finish_reason`` (or ``error``) together with its last piece of text.
    """

    request_id: str
    text: str = ""
    logprobs: tuple[LogprobEntry, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    timings: RequestTimings | None = None  # on the last update
    error: ErrorInfo | None = None
    # ``prompt_logprobs`` requests, in the first update: one entry per prompt token, the first
    # None (nothing predicts it)
    prompt_logprobs: tuple[LogprobEntry | None, ...] | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merge(self, later: RequestUpdate) -> RequestUpdate:
        """This update followed by ``later`` (same request) as one update."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = (logprobs or ()) + later.logprobs
        return replace(later, text=self.text + later.text, logprobs=logprobs,
                       prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


@dataclass(frozen=True)
class UpdateBatch:
    """Updates for the requests of one API process, in the order the engine produced them."""

    updates: tuple[RequestUpdate, ...]


@dataclass(frozen=True)
class WorkerLost:
    """An engine worker died: every request of its model in flight in this API process failed.

    ``request_queue`` is the replacement worker's request queue (a Manager proxy). A worker
    killed while blocked in ``get()`` on the old queue leaves a Manager thread that would
    swallow the next message put there, so every restart gets a fresh queue.
    """

    error: ErrorInfo
    request_queue: Any = None
    deployment: str = ""  # which model's worker (its ``models:`` key; "" for a lone model)


WorkerOutbound = UpdateBatch | WorkerLost
