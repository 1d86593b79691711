"""One engine replica of the Ray host: the LLM engine, its scheduler and its loop in a Serve replica.

Inside the replica process the engine runs exactly as in the single-machine engine worker:
``WorkerService.load`` builds and warms it up, and ``EngineLoop.run(service, inbox, outbox)`` (the
same class) drives it from its own thread. Only the two hand-offs differ::

    generate(SubmitRequest, reply_to) -> Inbox -> engine thread
    engine thread -> Outbox -> sender thread -> ReplyTransport: one message per flush per ingress
                                                replica (``transport.UpdateSender``, ZeroMQ)

``generate`` is a plain (not streaming) handle method: it returns once the request's final
update has been sent, so Serve counts the request as ongoing for as long as it runs (routing,
``max_ongoing_requests``, autoscaling) and fails the call when the replica dies. Its updates do
not travel in the call: the ``Outbox`` merges the updates of every request of an engine step by
ingress replica, and each ingress gets them in one message, at most one per
``stream_batching_interval_ms`` (the first after a pause, one that starts a request's stream
and one that ends a request go at once). A caller that goes away cancels the call, which cancels the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from inferflow.server.lora import LoraServing
from inferflow.server.messages import (
    CancelRequest,
    ErrorInfo,
    LoadLora,
    LoraControl,
    RequestUpdate,
    StopWorker,
    SubmitRequest,
    UpdateBatch,
)
from inferflow.server.observability import TelemetrySettings
from inferflow.server.ray.board import board_actor, report_forever
from inferflow.server.ray.routing import MISROUTED, Misrouted, ReplicaProbe
from inferflow.server.ray.transport import UpdateSender
from inferflow.server.shared_state import SharedState
from inferflow.server.worker.loop import EngineLoop
from inferflow.server.worker.queues import Inbox, Outbox
from inferflow.server.worker.service import GraphEngineFactory, WorkerService

logger = logging.getLogger(__name__)

ENGINE_GONE = ErrorInfo(
    503, "the engine of this replica stopped; retry", code="replica_lost", retry_after_s=1
)
METRICS_EVERY_S = 2.0  # Prometheus text rendered for the board at most this often (~ms each)
DRAIN_WAIT_S = 2.0  # graceful shutdown: how long the last answers may take to leave


class ReplyTransport:
    """The ``UpdateSink`` the replica's ``Outbox`` sends to: consumer id = one ingress replica's
    address; each ``UpdateBatch`` is one message to it. After a send, ``on_final`` gets the ids
    of the requests whose final update it carried (their calls may return)."""

    def __init__(
        self, sender: UpdateSender, interval_s: float, on_final: Callable[[list[str]], None]
    ) -> None:
        self.sender, self.interval_s, self.on_final = sender, interval_s, on_final
        self.addresses: dict[int, str] = {}
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()
        self._sent_at: dict[int, float] = {}  # sender thread only
        self._streaming: set[str] = set()  # requests with an update sent (sender thread only)

    def consumer(self, address: str) -> int:
        """The consumer id of the ingress replica at ``address`` (made on first use)."""
        with self._lock:
            cid = self._ids.get(address)
            if cid is None:
                cid = self._ids[address] = len(self._ids)
                self.addresses[cid] = address
            return cid

    def send(self, item: Any, consumer_id: int) -> None:
        if not isinstance(item, UpdateBatch):
            return
        finals = [u.request_id for u in item.updates if u.final]
        firsts = [u.request_id for u in item.updates if u.request_id not in self._streaming]
        # at most one message per interval to each ingress (what arrives meanwhile joins the
        # next one: the Outbox merges it), unless it starts a request's stream (its first token:
        # TTFT is not paced) or ends one (a slot's next request waits for that answer)
        wait = self._sent_at.get(consumer_id, float("-inf")) + self.interval_s - time.monotonic()
        if wait > 0 and not finals and not firsts:
            time.sleep(wait)
        try:
            self.sender.send(self.addresses[consumer_id], item)
        finally:  # sent or not (the ingress is gone), these calls are over
            self._sent_at[consumer_id] = time.monotonic()
            self._streaming.update(firsts)
            self._streaming.difference_update(finals)
            if finals:
                self.on_final(finals)


class EngineReplica:
    """The engine deployment's class (``serve.deployment`` options are set by the host): one per
    LLM of the repository (``model_key``: its ``models:`` key, "" for a lone model).

    ``config`` is the entry's composed graph as a plain dict; every replica rebuilds the same
    graph. ``transport_key`` signs the update messages (``transport.py``).
    """

    def __init__(
        self,
        config: dict[str, Any],
        telemetry: TelemetrySettings,
        log_level: str,
        board_name: str | None = None,
        watchdog_s: float | None = 30.0,
        stream_batching_interval_ms: float = 50.0,
        model_key: str = "",
        transport_key: str = "",
    ) -> None:
        from ray import serve

        logging.basicConfig(level=log_level.upper())
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.model_key = model_key
        self.watchdog_s = watchdog_s
        self.board_name = board_name
        self.shared = SharedState()
        self.service = WorkerService(
            GraphEngineFactory(config),
            self.shared,
            replace(telemetry, replica_id=self.replica_id),
            lora=LoraServing.from_config(config),
        )
        started = time.time()
        self.service.load()  # build + warm up: the replica is not ready before this returns
        self._apply_runtime_adapters()
        logger.info("replica %s: engine ready in %.2f s", self.replica_id, time.time() - started)
        self.loop: asyncio.AbstractEventLoop | None = None
        # request id -> (the future its call awaits, the ingress address its updates go to)
        self.pending: dict[str, tuple[asyncio.Future[None], str]] = {}
        self.sender = UpdateSender(bytes.fromhex(transport_key) if transport_key else b"")
        self.transport = ReplyTransport(
            self.sender, stream_batching_interval_ms / 1000.0, self._finals_sent
        )
        self.inbox = Inbox()
        self.outbox = Outbox(self.transport)
        self._stop = threading.Event()
        self.engine_thread = threading.Thread(
            target=self._run_engine, name="inferflow-engine", daemon=True
        )
        self.engine_thread.start()
        self._metrics, self._metrics_at = "", float("-inf")
        if board_name is not None:
            threading.Thread(
                target=report_forever,
                name="inferflow-board",
                daemon=True,
                args=(board_name, self.replica_id, self.report, self._stop),
            ).start()

    def _apply_runtime_adapters(self) -> None:
        """Adapters loaded or unloaded at run time (on the board) apply to this replica too,
        before it serves: every replica of a model serves the same adapters."""
        if self.service.lora is None or self.board_name is None:
            return
        import ray

        try:
            changes = ray.get(
                board_actor(self.board_name).adapters.remote(self.model_key), timeout=10
            )
        except Exception as exc:
            logger.warning(
                "replica %s: runtime adapters not read from the board: %s", self.replica_id, exc
            )
            return
        for name, path in changes.items():
            served = name in self.service.lora_names()
            try:
                if served and self.service.lora_paths.get(name) != path:
                    self.service.unload_lora(name)  # unloaded, or loaded again from elsewhere
                    served = False
                if path is not None and not served:
                    self.service.load_lora(name, path)
            except Exception as exc:
                logger.warning("replica %s: runtime adapter %s: %s", self.replica_id, name, exc)

    def _run_engine(self) -> None:
        """The engine thread: ``EngineLoop`` until it stops or fails; then every call still
        open (requests it never took, or took after failing) gets an explicit error."""
        self.outbox.start()
        try:
            EngineLoop().run(self.service, self.inbox, self.outbox)
        except BaseException:
            logger.exception("replica %s: the engine loop failed", self.replica_id)
        finally:
            self.outbox.close()
            self.service.close()
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._fail_pending, ENGINE_GONE)

    def _finals_sent(self, request_ids: list[str]) -> None:  # sender thread
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._resolve, request_ids)

    def _resolve(self, request_ids: list[str]) -> None:  # event-loop thread
        for request_id in request_ids:
            entry = self.pending.get(request_id)
            if entry is not None and not entry[0].done():
                entry[0].set_result(None)

    def _fail_pending(self, error: ErrorInfo) -> None:  # event-loop thread
        """Every open call ends with ``error`` (sent to its ingress first)."""
        by_address: dict[str, list[RequestUpdate]] = {}
        for request_id, (_, address) in self.pending.items():
            by_address.setdefault(address, []).append(RequestUpdate(request_id, error=error))
        for address, updates in by_address.items():
            self._send_now(address, updates)
        self._resolve(list(self.pending))

    def _send_now(self, address: str, updates: list[RequestUpdate]) -> None:
        try:
            self.sender.send(address, UpdateBatch(tuple(updates)))
        except OSError as exc:
            logger.warning("replica %s: %s", self.replica_id, exc)

    async def _call(self, request_id: str, reply_to: str, message: Any) -> str:
        """Put ``message`` (a request or a LoRA control) into the engine's inbox and wait until
        its final update was sent to ``reply_to``; a caller that leaves cancels it."""
        self.loop = asyncio.get_running_loop()
        done = self.loop.create_future()
        self.pending[request_id] = (done, reply_to)
        if not self.engine_thread.is_alive() or self._stop.is_set():
            self._send_now(reply_to, [RequestUpdate(request_id, error=ENGINE_GONE)])
            self.pending.pop(request_id, None)
            return "lost"
        self.inbox.put(replace(message, consumer_id=self.transport.consumer(reply_to)))
        finished = False
        try:
            await done
            finished = True
            return "done"
        finally:
            self.pending.pop(request_id, None)
            if not finished:  # the caller left (client gone, ingress cancelled, timeout)
                self.inbox.put(CancelRequest(request_id, "client_disconnected"))

    # --- the request path ----------------------------------------------------------------------
    async def generate(self, request: SubmitRequest, reply_to: str) -> str:
        """Run ``request``; its updates go to the ingress replica at ``reply_to``. Returns when
        its final update has been sent."""
        return await self._call(request.request_id, reply_to, request)

    async def probe(self, probe: ReplicaProbe) -> str:
        """Readiness through the request path: this replica's id while its engine runs."""
        if not self.engine_thread.is_alive() or self._stop.is_set():
            raise RuntimeError("the engine of this replica is not running")
        return self.replica_id

    async def control(self, probe: ReplicaProbe, message: LoraControl, reply_to: str) -> str:
        """Load or unload a LoRA adapter here (``probe`` routed the call to this replica); the
        answer is one final update under ``message.request_id``, as for a request. Loading an
        adapter this replica already serves from the same folder (it read it from the board when
        it started) succeeds as is. A call meant for another replica (Serve's router does not
        always keep a named replica: seen with two concurrent calls) raises ``Misrouted``
        before it touches anything: the ingress sends it again."""
        if probe.replica_id is not None and probe.replica_id != self.replica_id:
            raise Misrouted(f"{MISROUTED}: for {probe.replica_id}, reached {self.replica_id}")
        if (
            isinstance(message, LoadLora)
            and self.service.lora is not None
            and self.service.lora_paths.get(message.name) == message.path
            and message.name in self.service.lora_names()
        ):
            text = f"Success: LoRA adapter '{message.name}' added successfully."
            self._send_now(
                reply_to, [RequestUpdate(message.request_id, text=text, finish_reason="stop")]
            )
            return "done"
        return await self._call(message.request_id, reply_to, message)

    # --- state ---------------------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        """What this replica publishes (``/admin/stats``, ``/metrics``, readiness, adapters)."""
        telemetry, now = self.service.telemetry, time.monotonic()
        if telemetry is not None and now - self._metrics_at >= METRICS_EVERY_S:
            self._metrics, self._metrics_at = telemetry.metrics_text(), now
        return {
            "replica_id": self.replica_id,
            "model": self.model_key,
            "pid": os.getpid(),
            "ready": self.shared.ready and self.engine_thread.is_alive(),
            "stats": self.shared.stats(),
            "executor": self.shared.executor_stats(),
            "info": self.shared.info(),
            "metrics": self._metrics,
            "lora": self.shared.lora(),
        }

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
        running with an explicit 503, let those errors reach their ingress, stop the loop."""
        stop = getattr(self, "_stop", None)
        if stop is None:
            return
        stop.set()
        self.inbox.put(
            StopWorker(ErrorInfo(503, "the engine replica is shutting down", code="shutting_down"))
        )
        await asyncio.to_thread(self.engine_thread.join, 5)
        deadline = time.monotonic() + DRAIN_WAIT_S
        while self.pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self.sender.close()
