"""Per-request channels in an API process, fed by one dispatcher task.

The dispatcher reads this process's response queue (``DirectTransport``) and routes each
``RequestUpdate`` of an ``UpdateBatch`` to its request's channel; a ``WorkerLost`` notice goes
to ``on_worker_lost`` (the frontend switches queues and fails every open channel). A reader takes *all* updates queued on its channel at once and merges them,
so a stream that falls behind the engine sends fewer, larger SSE chunks instead of lagging.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from inferflow.server.messages import ErrorInfo, RequestUpdate, UpdateBatch, WorkerLost

logger = logging.getLogger(__name__)

NONE_SPIN_S = 0.05  # an immediate None from the transport (its queue is gone): back off this long


class UpdateSource(Protocol):
    """This process's end of the worker -> API process transport (``DirectTransport``)."""

    async def areceive(self, consumer_id: int, timeout: float | None = None) -> object: ...


class RequestChannel:
    """Updates for one request, in order. Only touched from the event loop thread."""

    def __init__(self, request_id: str, deployment: str = "") -> None:
        self.request_id = request_id
        self.deployment = deployment  # the model version whose worker runs it
        self._updates: deque[RequestUpdate] = deque()
        self._event = asyncio.Event()
        self.finished = False  # a final update (finish_reason or error) has been queued
        self.worker_done = False  # the worker sent that final update: it holds nothing more

    def push(self, update: RequestUpdate, from_worker: bool = True) -> None:
        if self.finished:
            return
        self._updates.append(update)
        self.finished = update.final
        self.worker_done = self.finished and from_worker
        self._event.set()

    def fail(self, error: ErrorInfo) -> None:
        """Fail the request from this side (the worker may still hold it: cancel it there)."""
        self.push(RequestUpdate(request_id=self.request_id, error=error), from_worker=False)

    async def next(self, timeout: float | None) -> RequestUpdate:
        """Every update queued since the last call, merged into one; waits up to ``timeout``.

        Raises ``asyncio.TimeoutError`` when nothing arrived in time. Deliberately not built on
        ``asyncio.wait_for``: on Python 3.11 it swallows a cancellation that races with the
        awaited event (updates arrive every few ms), and a stream whose client left would then
        keep running until its last token instead of being cancelled.
        """
        if not self._updates:
            self._event.clear()
            alarm = None
            if timeout is not None:
                alarm = asyncio.get_running_loop().call_later(max(0.0, timeout), self._event.set)
            try:
                await self._event.wait()
            finally:
                if alarm is not None:
                    alarm.cancel()
            if not self._updates:
                raise asyncio.TimeoutError
        merged = self._updates.popleft()
        while self._updates:
            merged = merged.merge(self._updates.popleft())
        return merged


class ChannelRegistry:
    """The open channels of this API process and the task that feeds them."""

    def __init__(self, on_worker_lost: Callable[[WorkerLost], None] | None = None) -> None:
        self.on_worker_lost = on_worker_lost
        self._channels: dict[str, RequestChannel] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self, request_id: str, deployment: str = "") -> RequestChannel:
        channel = RequestChannel(request_id, deployment)
        self._channels[request_id] = channel
        self._idle.clear()
        return channel

    def close(self, request_id: str) -> None:
        self._channels.pop(request_id, None)
        if not self._channels:
            self._idle.set()

    def __len__(self) -> int:
        return len(self._channels)

    def fail_all(self, error: ErrorInfo, deployment: str | None = None) -> list[str]:
        """Push ``error`` to every open channel (of ``deployment`` only, when given); returns
        their request ids."""
        failed = [
            c for c in self._channels.values() if deployment is None or c.deployment == deployment
        ]
        for channel in failed:
            channel.fail(error)
        return [c.request_id for c in failed]

    async def wait_idle(self, timeout: float) -> bool:
        """True once no channel is open (within ``timeout`` seconds)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def dispatch(self, message: object) -> None:
        if isinstance(message, UpdateBatch):
            for update in message.updates:
                channel = self._channels.get(update.request_id)
                if channel is not None:
                    channel.push(update)
        elif isinstance(message, WorkerLost) and self.on_worker_lost is not None:
            self.on_worker_lost(message)

    async def pump(self, transport: UpdateSource, consumer_id: int) -> None:
        """Dispatch messages from this process's response queue until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                message = await transport.areceive(consumer_id=consumer_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the Manager is gone: nothing more will arrive
                logger.warning("response queue %d closed: %s", consumer_id, exc)
                return
            if message is None:
                # LitServe's transport answers None on its 1 s poll timeout, and also at once
                # when the queue is gone: then wait a little instead of spinning
                if loop.time() - started < NONE_SPIN_S:
                    await asyncio.sleep(NONE_SPIN_S)
                continue
            try:
                self.dispatch(message)
            except Exception:  # one bad message must not stop every later request
                logger.exception("cannot dispatch %s", type(message).__name__)
