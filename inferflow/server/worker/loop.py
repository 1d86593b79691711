"""The engine worker's continuous-batching loop, host-independent: ``EngineLoop.run(service,
inbox, outbox)`` is the engine thread of the three (see :mod:`inferflow.server.worker.queues`).

LitServe 0.2.19's own ``ContinuousBatchingLoop`` adds requests from an asyncio task while
``step`` runs in a thread (a race), drops the payload of the final ``FINISH_STREAMING`` output,
spins a core when idle, and never cancels or times out a sequence; this loop does not:

- the engine thread is the only one that calls the engine: it applies queued submits/cancels,
  aborts requests past their deadline, runs one ``engine.step()`` and posts the deltas;
- it blocks on the inbox when the engine has no unfinished request (~0% CPU when idle);
- a cancel or an expired deadline calls ``engine.abort_request`` before the next step, so the
  slot and KV blocks are free within one step; a request's last delta travels together with
  its ``finish_reason`` and is never dropped;
- a LoRA control message (``LoadLora``/``UnloadLora``) is applied between two steps, in order
  with the submits around it, and answered with one final ``RequestUpdate`` under its id.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from inferflow.lora import LoraError
from inferflow.outputs import RequestOutput, TokenLogprob
from inferflow.sampling_params import RequestOutputKind
from inferflow.server.messages import (
    CancelRequest,
    ErrorInfo,
    LoadLora,
    LogprobEntry,
    LoraControl,
    RequestUpdate,
    StopWorker,
    SubmitRequest,
    UnloadLora,
    WorkerInbound,
)
from inferflow.server.worker.queues import Inbox, Outbox
from inferflow.server.worker.service import WorkerService

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # how often an idle engine thread proves it is alive


@dataclass
class _Active:
    """Bookkeeping for one request the engine is running (its outputs are DELTAs: the counts
    are summed here)."""

    consumer_id: int
    deadline: float | None
    timeout_s: float | None
    prompt_tokens: int
    completion_tokens: int = 0


class EngineLoop:
    """Drives one ``LLMEngine`` through a ``WorkerService``, whichever host runs it.

    ``run(service, inbox, outbox)`` is the engine thread; the host feeds ``inbox`` and has
    started ``outbox`` (LitServe's worker: ``litserve.engine_api.run_worker``; the Ray replica:
    ``ray.engine_replica``).
    """

    def __init__(self) -> None:
        self._active: dict[str, _Active] = {}
        self._counters = {"finished_requests": 0, "aborted_requests": 0, "timed_out_requests": 0}
        self._outbox: Outbox | None = None

    def run(self, service: WorkerService, inbox: Inbox, outbox: Outbox) -> None:
        """The engine thread: apply inbound messages, expire deadlines, step, publish."""
        self._outbox = outbox
        engine = service.live_engine
        service.heartbeat()
        self._publish_stats(service)
        service.mark_ready()
        while True:
            # idle, the thread wakes once per HEARTBEAT_S to say it is alive (the watchdog's
            # input); a step or a message beats too
            messages = inbox.take_all(
                wait=not engine.has_unfinished_requests(), timeout=HEARTBEAT_S
            )
            service.heartbeat()
            stop = self._apply(messages, service)
            if stop is not None:
                self._fail_all(service, stop.error)
                self._publish_stats(service)
                return
            self._expire(service, time.time())
            if engine.has_unfinished_requests():
                self._step(service)
            self._publish_stats(service)

    # --- inbound ------------------------------------------------------------------------------
    def _apply(self, messages: list[WorkerInbound], service: WorkerService) -> StopWorker | None:
        for message in messages:
            if isinstance(message, SubmitRequest):
                self._add(message.request_id, message, service)
            elif isinstance(message, CancelRequest):
                self._cancel(service, message.request_id)
            elif isinstance(message, LoadLora | UnloadLora):
                self._control(message, service)
            elif isinstance(message, StopWorker):
                return message
        return None

    def _add(self, uid: str, request: SubmitRequest, service: WorkerService) -> None:
        """Hand ``request`` to the engine; a request it refuses gets its 400 right away."""
        engine = service.live_engine
        now = time.time()
        timeout = None if request.deadline is None else request.deadline - request.arrival_time
        if request.deadline is not None and now >= request.deadline:
            self._post(request.consumer_id, RequestUpdate(uid, error=_timeout_error(timeout)))
            self._counters["timed_out_requests"] += 1
            return
        try:
            # the engine's clock starts here: queue time is waiting in the scheduler's queue,
            # not the request stages or the hop from the API process (the root span has those)
            engine.add_request(
                uid,
                request.prompt_token_ids,
                # only what is new in each output: no copy of the past tokens per step
                replace(request.params, output_kind=RequestOutputKind.DELTA),
                arrival_time=now,
                priority=request.priority,
                prompt_leader=request.prompt_leader,
                lora=request.lora,
            )
        except ValueError as exc:
            param = getattr(exc, "field", None)
            if request.lora is not None and param == "model":  # unloaded since it was routed
                error = _unknown_adapter(request.lora)
            else:
                error = ErrorInfo(400, str(exc), param=param)
            self._post(request.consumer_id, RequestUpdate(uid, error=error))
            return
        self._active[uid] = _Active(
            request.consumer_id, request.deadline, timeout, len(request.prompt_token_ids)
        )
        service.request_added(request, accepted_time=now)

    def _control(self, message: LoraControl, service: WorkerService) -> None:
        """Load or unload an adapter; the answer is one final update under the message's id:
        ``finish_reason="stop"`` with vLLM's success text, else a 400 naming the field (a
        404 for unloading an adapter the engine does not serve)."""
        name = message.name
        try:
            if isinstance(message, LoadLora):
                service.load_lora(name, message.path)
                text = f"Success: LoRA adapter '{name}' added successfully."
            else:
                if name not in service.lora_names():
                    raise _NotServed(name)
                service.unload_lora(name)
                text = f"Success: LoRA adapter '{name}' removed successfully."
        except _NotServed:
            error = ErrorInfo(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                code="lora_not_found",
            )
            update = RequestUpdate(message.request_id, error=error)
        except LoraError as exc:
            error = ErrorInfo(400, str(exc), param=exc.field)
            update = RequestUpdate(message.request_id, error=error)
        except Exception as exc:  # e.g. an unreadable file: the client's adapter, not the engine
            logger.warning("LoRA %s of %r failed: %s", type(message).__name__, name, exc)
            param = "lora_path" if isinstance(message, LoadLora) else "lora_name"
            update = RequestUpdate(
                message.request_id,
                error=ErrorInfo(400, f"{type(exc).__name__}: {exc}", param=param),
            )
        else:
            logger.info(text)
            update = RequestUpdate(message.request_id, text=text, finish_reason="stop")
        self._post(message.consumer_id, update)

    def _cancel(self, service: WorkerService, uid: str) -> None:
        if uid in self._active:
            self._abort(service, uid, "cancelled")
            self._counters["aborted_requests"] += 1

    def _expire(self, service: WorkerService, now: float) -> None:
        expired = [
            uid for uid, a in self._active.items() if a.deadline is not None and now >= a.deadline
        ]
        for uid in expired:
            record = self._abort(service, uid, "timeout")
            self._counters["timed_out_requests"] += 1
            error = _timeout_error(record.timeout_s)
            self._post(record.consumer_id, RequestUpdate(uid, error=error))

    def _fail_all(self, service: WorkerService, error: ErrorInfo) -> None:
        for uid in list(self._active):
            record = self._abort(service, uid, error.code or "error")
            self._post(record.consumer_id, RequestUpdate(uid, error=error))

    def _abort(self, service: WorkerService, uid: str, why: str) -> _Active:
        """Free the request's slot and KV blocks now and close its telemetry."""
        record = self._active.pop(uid)
        service.live_engine.abort_request(uid)
        service.request_done(uid, "abort", None, None, error=why)
        return record

    # --- outbound -----------------------------------------------------------------------------
    def _step(self, service: WorkerService) -> None:
        try:
            outputs = service.live_engine.step()
        except Exception:
            logger.exception("engine step failed; failing the running requests and restarting")
            error = ErrorInfo(
                500, "the engine failed while running this request", code="engine_error"
            )
            self._fail_all(service, error)
            raise
        for output in outputs:
            record = self._active.get(output.request_id)
            if record is None:  # cancelled or timed out earlier: nobody is listening
                continue
            update = _update_from(output, record, service.token_text)
            if update.final:
                self._active.pop(output.request_id, None)
                self._counters["finished_requests"] += 1
                timings = service.request_done(
                    output.request_id,
                    update.finish_reason or "abort",
                    output.metrics,
                    update.completion_tokens,
                    error=update.error.code if update.error else None,
                )
                update = replace(update, timings=timings)
            self._post(record.consumer_id, update)

    def _post(self, consumer_id: int, update: RequestUpdate) -> None:
        assert self._outbox is not None
        self._outbox.post(consumer_id, update)

    def _publish_stats(self, service: WorkerService) -> None:
        service.publish_stats(dict(self._counters, worker_pid=os.getpid()))


class _NotServed(Exception):
    """Unloading an adapter the engine does not serve (a 404)."""


def _unknown_adapter(name: str) -> ErrorInfo:
    """The 404 of a request for an adapter the engine no longer serves (OpenAI's shape)."""
    return ErrorInfo(
        404, f"The model `{name}` does not exist (the LoRA adapter was unloaded).",
        param="model", code="model_not_found",
    )


def _timeout_error(timeout: float | None) -> ErrorInfo:
    return ErrorInfo(504, f"the request did not finish within {timeout:.3g} s", code="timeout")


def _update_from(
    output: RequestOutput, record: _Active, token_text: Callable[[int], str]
) -> RequestUpdate:
    """One DELTA ``RequestOutput`` as a ``RequestUpdate`` for the frontend."""
    completion = output.outputs[0]
    record.completion_tokens += len(completion.token_ids)
    logprobs = None
    if completion.logprobs is not None:
        logprobs = tuple(_entry(lp, token_text) for lp in completion.logprobs)
    prompt_logprobs = None  # (a DELTA output carries them in the request's first output only)
    if output.prompt_logprobs is not None:
        prompt_logprobs = tuple(
            None if lp is None else _entry(lp, token_text) for lp in output.prompt_logprobs
        )
    error = None
    if completion.finish_reason == "abort":  # aborted by the engine itself, not by us
        error = ErrorInfo(500, "the engine aborted this request", code="aborted")
    cached = output.metrics.num_cached_prompt_tokens if output.metrics is not None else 0
    return RequestUpdate(
        request_id=output.request_id,
        text=completion.delta_text,
        logprobs=logprobs,
        finish_reason=None if error else completion.finish_reason,
        stop_reason=completion.stop_reason,
        prompt_tokens=record.prompt_tokens,
        completion_tokens=record.completion_tokens,
        cached_tokens=cached,
        error=error,
        prompt_logprobs=prompt_logprobs,
    )


def _entry(lp: TokenLogprob, token_text: Callable[[int], str]) -> LogprobEntry:
    """One token's logprob (generated or prompt) with its text and its top alternatives'."""
    return LogprobEntry(
        token_text(lp.token_id),
        lp.token_id,
        lp.logprob,
        tuple((token_text(t), t, p) for t, p in lp.top),
    )
