"""Typed messages between the processes of a running server.

::

    API process --SubmitRequest/CancelRequest--> request queue (LitServe Manager) --> engine worker
    engine worker --UpdateBatch--> response queue of that API process (one per API process)
    supervisor (main process) --WorkerLost--> every API response queue
    supervisor --StopWorker--> request queue

Every queue put is a Manager round-trip, so the worker sends ONE ``UpdateBatch`` per API process
per flush, carrying the new text of every request that advanced; ``RequestUpdate.merge`` folds
several steps of one request into one update when the transport falls behind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from inferflow.sampling_params import SamplingParams
from inferflow.server.http.errors import ErrorInfo


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


@dataclass(frozen=True)
class CancelRequest:
    """Abort a request (client disconnected, frontend timeout, worker restart)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class StopWorker:
    """Fail whatever is still running with ``error`` and leave the engine loop."""

    error: ErrorInfo


WorkerInbound = SubmitRequest | CancelRequest | StopWorker


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
    timings: dict[str, Any] | None = None  # RequestTimings.to_dict(), on the last update
    error: ErrorInfo | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merge(self, later: RequestUpdate) -> RequestUpdate:
        """This update followed by ``later`` (same request) as one update."""
        logprobs = self.logprobs
        if later.logprobs is not None:
            logprobs = (logprobs or ()) + later.logprobs
        return replace(later, text=self.text + later.text, logprobs=logprobs)


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
