"""The engine worker's two hand-offs: requests in (``Inbox``) and updates out (``Outbox``).

Thread layout of the worker process::

    intake thread : request_queue.get()  (blocks in the Manager)  -> Inbox.put
    engine thread : Inbox.take_all -> engine.add/abort/step       -> Outbox.post   (sole engine user)
    sender thread : Outbox batches -> transport.send, one message per API process

(The Ray replica has no intake thread: its event loop puts into the ``Inbox`` directly.)

Only the engine thread touches the engine, so adding a request can never race a step. Every
thread blocks on a condition or a queue when there is nothing to do: an idle worker uses no CPU.
The outbox merges the updates that pile up while a send is in flight, so a slow transport gets
fewer, larger messages (tokens coalesced per message) instead of a growing backlog.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Protocol

from inferflow.server.messages import (
    QUEUE_LOST,
    ErrorInfo,
    RequestUpdate,
    StopWorker,
    UpdateBatch,
    WorkerInbound,
)

logger = logging.getLogger(__name__)


class RequestSource(Protocol):
    """Where the intake thread reads inbound messages (LitServe's Manager queue, whose stop
    sentinel is ``None`` or a tuple of ``None``)."""

    def get(self) -> WorkerInbound | tuple[None, ...] | None: ...


class UpdateSink(Protocol):
    """Where the sender thread sends ``UpdateBatch``es (``DirectTransport``; the Ray replica's
    ``ReplyTransport``): one message per API process or ingress replica (``consumer_id``)."""

    def send(self, item: UpdateBatch, consumer_id: int) -> None: ...


class Inbox:
    """A FIFO of inbound messages the engine thread drains all at once."""

    def __init__(self) -> None:
        self._items: deque[WorkerInbound] = deque()
        self._cond = threading.Condition()

    def put(self, item: WorkerInbound) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def take_all(self, wait: bool, timeout: float | None = None) -> list[WorkerInbound]:
        """Everything queued, in order; with ``wait`` block until at least one item arrives
        (or ``timeout`` seconds passed: then possibly nothing)."""
        with self._cond:
            if wait:
                self._cond.wait_for(lambda: self._items, timeout)
            items = list(self._items)
            self._items.clear()
            return items


def pump_requests(request_queue: RequestSource, inbox: Inbox) -> None:
    """Intake thread: move messages from LitServe's request queue into ``inbox`` until stopped.

    LitServe's sentinel (a tuple of ``None``) or a lost Manager also stop the worker.
    """
    while True:
        try:
            item = request_queue.get()
        except (EOFError, OSError) as exc:  # the Manager is gone: the server is going down
            logger.info("request queue closed (%s); stopping the engine loop", exc)
            # the updates still reach the API processes (DirectTransport): say why they end
            item = StopWorker(QUEUE_LOST)
        if item is None or isinstance(item, tuple):
            item = StopWorker(ErrorInfo(503, "the server is shutting down", code="shutting_down"))
        inbox.put(item)
        if isinstance(item, StopWorker):
            return


class Outbox:
    """Coalescing sender of ``RequestUpdate``s, one ``UpdateBatch`` per API process per send."""

    def __init__(self, transport: UpdateSink) -> None:
        self._transport = transport
        # consumer id -> request id -> merged pending update (dicts keep arrival order)
        self._pending: dict[int, dict[str, RequestUpdate]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="inferflow-sender", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def post(self, consumer_id: int, update: RequestUpdate) -> None:
        with self._cond:
            queue = self._pending.setdefault(consumer_id, {})
            previous = queue.get(update.request_id)
            queue[update.request_id] = previous.merge(update) if previous else update
            self._cond.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Send what is pending, then stop the sender thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _take(self) -> dict[int, dict[str, RequestUpdate]] | None:
        with self._cond:
            while not self._pending and not self._closed:
                self._cond.wait()
            if not self._pending:
                return None
            batch, self._pending = self._pending, {}
            return batch

    def _run(self) -> None:
        while (batch := self._take()) is not None:
            for consumer_id, updates in batch.items():
                try:
                    self._transport.send(
                        UpdateBatch(tuple(updates.values())), consumer_id=consumer_id
                    )
                except (EOFError, OSError) as exc:
                    logger.warning("cannot send updates to API process %d: %s", consumer_id, exc)
