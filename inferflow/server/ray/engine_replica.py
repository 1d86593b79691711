"""One engine replica of the Ray host: the LLM engine, its scheduler and its loop in a Serve replica.

Inside the replica process the engine runs exactly as in the single-machine engine worker:
``WorkerService.load`` builds and warms it up, and ``EngineLoop.run(service, inbox, outbox)`` (the
same class) drives it from its own thread. Only the two hand-offs differ::

    generate(SubmitRequest)  -> Inbox -> engine thread
    engine thread -> Outbox -> sender thread -> StreamTransport.send -> the request's stream
                                                              (an asyncio queue on Serve's loop)

``generate`` is a streaming handle method: it yields ``RequestUpdate``s until the final one, each
the merge of what arrived since the previous yield and at most one per
``stream_batching_interval_ms`` after the first (every yield is a Ray message: on a 2-core machine
one per token costs more than the engine step). A consumer that goes away cancels the generator, which cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import pickle
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from inferflow.server.messages import (
    CancelRequest,
    ErrorInfo,
    RequestUpdate,
    StopWorker,
    SubmitRequest,
    UpdateBatch,
)
from inferflow.server.observability import TelemetrySettings
from inferflow.server.ray.board import report_forever
from inferflow.server.shared_state import SharedState
from inferflow.server.worker.loop import EngineLoop
from inferflow.server.worker.queues import Inbox, Outbox
from inferflow.server.worker.service import GraphEngineFactory, WorkerService

logger = logging.getLogger(__name__)

CONSUMER_ID = 0  # one consumer: the replica's streams, told apart by request id
ENGINE_GONE = ErrorInfo(503, "the engine of this replica stopped; retry", code="replica_lost",
                        retry_after_s=1)
METRICS_EVERY_S = 2.0  # Prometheus text rendered for the board at most this often (~ms each)


class _Stream:
    """Updates of one request, pushed from the sender thread, read on Serve's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.updates: list[RequestUpdate] = []
        self.event = asyncio.Event()

    def push(self, update: RequestUpdate) -> None:  # event-loop thread only
        self.updates.append(update)
        self.event.set()

    async def next(self, not_before: float = 0.0) -> RequestUpdate:
        """Everything that arrived since the last call, merged into one update; not returned
        before ``not_before`` (the event loop's clock), so updates arriving until then join."""
        while not self.updates:
            self.event.clear()
            await self.event.wait()
        delay = not_before - self.loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        merged, rest = self.updates[0], self.updates[1:]
        self.updates = []
        for later in rest:
            merged = merged.merge(later)
        return merged


class StreamTransport:
    """The ``MessageTransport`` the worker's ``Outbox`` sends to: routes each update of a batch
    to its request's stream (one ``call_soon_threadsafe`` per batch)."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def open(self, request_id: str) -> _Stream:
        self.loop = asyncio.get_running_loop()
        stream = self.streams[request_id] = _Stream(self.loop)
        return stream

    def close(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def send(self, item: Any, consumer_id: int | None = None) -> None:
        if isinstance(item, UpdateBatch) and self.loop is not None:
            self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, batch: UpdateBatch) -> None:
        for update in batch.updates:
            stream = self.streams.get(update.request_id)
            if stream is not None:
                stream.push(update)


class EngineReplica:
    """The engine deployment's class (``serve.deployment`` options are set by the host).

    ``config`` is the composed graph as a plain dict; every replica rebuilds the same graph.
    """

    def __init__(self, config: dict[str, Any], telemetry: TelemetrySettings, log_level: str,
                 board_name: str | None = None, watchdog_s: float | None = 30.0,
                 stream_batching_interval_ms: float = 50.0) -> None:
        from ray import serve

        logging.basicConfig(level=log_level.upper())
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.watchdog_s = watchdog_s
        self.stream_interval_s = stream_batching_interval_ms / 1000.0
        self.shared = SharedState()
        self.service = WorkerService(GraphEngineFactory(config), self.shared,
                                     replace(telemetry, replica_id=self.replica_id))
        started = time.time()
        self.service.load()  # build + warm up: the replica is not ready before this returns
        logger.info("replica %s: engine ready in %.2f s", self.replica_id, time.time() - started)
        self.inbox = Inbox()
        self.transport = StreamTransport()
        self.outbox = Outbox(self.transport)
        self.engine_thread = threading.Thread(target=self._run_engine, name="inferflow-engine",
                                              daemon=True)
        self.engine_thread.start()
        self._stop = threading.Event()
        self._metrics, self._metrics_at = "", float("-inf")
        if board_name is not None:
            threading.Thread(target=report_forever, name="inferflow-board", daemon=True,
                             args=(board_name, self.replica_id, self.report, self._stop)).start()

    def _run_engine(self) -> None:
        """The engine thread: ``EngineLoop`` until it stops or fails; then every stream still
        open (requests it never took, or took after failing) gets an explicit error."""
        self.outbox.start()
        try:
            EngineLoop().run(self.service, self.inbox, self.outbox)
        except BaseException:
            logger.exception("replica %s: the engine loop failed", self.replica_id)
        finally:
            self.outbox.close()
            self.service.close()
            if self.transport.loop is not None:
                self.transport.loop.call_soon_threadsafe(self._fail_open_streams)

    def _fail_open_streams(self) -> None:  # event-loop thread
        for request_id, stream in list(self.transport.streams.items()):
            stream.push(RequestUpdate(request_id=request_id, error=ENGINE_GONE))

    # --- the request path ----------------------------------------------------------------------
    async def generate(self, request: SubmitRequest) -> AsyncIterator[bytes]:
        """Run ``request``; yield its updates (pickled ``RequestUpdate``s) until the final one
        (a streaming handle call)."""
        stream = self.transport.open(request.request_id)
        if not self.engine_thread.is_alive():  # the health check will replace this replica
            stream.push(RequestUpdate(request_id=request.request_id, error=ENGINE_GONE))
        else:
            self.inbox.put(replace(request, consumer_id=CONSUMER_ID))
        final, not_before = False, 0.0
        try:
            while not final:
                update = await stream.next(not_before)
                not_before = stream.loop.time() + self.stream_interval_s
                final = update.final
                # stdlib pickle (C) in bytes: Ray would cloudpickle the dataclass in pure Python,
                # which cost a quarter of the replica's CPU at 32 streams
                yield pickle.dumps(update, protocol=pickle.HIGHEST_PROTOCOL)
        finally:
            self.transport.close(request.request_id)
            if not final:  # the consumer left (client gone, ingress cancelled, timeout)
                self.inbox.put(CancelRequest(request.request_id, "client_disconnected"))

    # --- state ---------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """What this replica publishes (``/admin/stats``, ``/metrics``, readiness)."""
        telemetry, now = self.service.telemetry, time.monotonic()
        if telemetry is not None and now - self._metrics_at >= METRICS_EVERY_S:
            self._metrics, self._metrics_at = telemetry.metrics_text(), now
        return {"replica_id": self.replica_id, "pid": os.getpid(), "ready": self.shared.ready,
                "stats": self.shared.stats(), "executor": self.shared.executor_stats(),
                "info": self.shared.info(), "metrics": self._metrics}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Ray Serve's custom autoscaling metric hook (read by ``queue_depth_policy``)."""
        stats = self.shared.stats()
        return {"queue_depth": float(stats.get("running", 0) + stats.get("waiting", 0))}

    def check_health(self) -> None:
        """Ray Serve's health probe: a replica whose engine thread died or stalled is replaced."""
        if not self.engine_thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        watchdog = self.watchdog_s
        if watchdog is not None and self.shared.heartbeat_age() > watchdog:
            raise RuntimeError(f"the engine thread has not gone round for {watchdog} s")

    async def __del__(self) -> None:
        """Serve's graceful shutdown (after its drain of ongoing requests): fail what is still
        running with an explicit 503, let those errors reach their streams, stop the loop."""
        stop = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        self.inbox.put(StopWorker(ErrorInfo(503, "the engine replica is shutting down",
                                               code="shutting_down")))
        await asyncio.to_thread(self.engine_thread.join, 5)
        for _ in range(40):  # the errors are delivered on this loop: give the streams a moment
            if not self.transport.streams:
                break
            await asyncio.sleep(0.05)
