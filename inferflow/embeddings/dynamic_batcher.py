"""Dynamic batching for one-shot models (encoders): group requests that arrive close together.

``submit(item)`` enqueues and returns a ``concurrent.futures.Future``; one worker thread forms
batches and calls ``batch_fn(items) -> results`` (same length, same order). Policy:

- items are queued per *length bucket* (``bucket_boundaries``), so a batch holds items of
  similar length and padding stays small;
- a bucket holding ``max_num_seqs`` items is dispatched at once (full batches first, the
  one with the oldest head wins);
- otherwise the bucket of the oldest queued item is dispatched when that item has waited
  ``max_delay_ms`` (0 = dispatch whatever is queued right away; batches still form while the
  previous batch runs);
- the queue is bounded: ``submit`` raises ``QueueFull`` (HTTP 429) instead of growing.

An idle worker blocks in ``Condition.wait()`` without a timeout: it uses no CPU until a
submit or ``close()`` notifies it. A future cancelled before its batch starts is skipped.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, TypeVar

from inferflow.stages.batching import DynamicBatching

T = TypeVar("T")
R = TypeVar("R")


def default_batching() -> DynamicBatching:
    """The batcher's settings without a ``batching=dynamic`` stage: 32 items per call."""
    return DynamicBatching(max_num_seqs=32)


class QueueFull(RuntimeError):
    """The batcher's queue is at ``max_queue_size``; retry later (HTTP 429)."""


class BatcherClosed(RuntimeError):
    """The batcher was closed; no new work is accepted and queued work is failed (HTTP 503)."""


class WorkerState(Enum):
    IDLE = "idle"  # blocked in an untimed wait: nothing queued
    WAITING = "waiting"  # timed wait: items queued, waiting for the batch to fill or the delay
    RUNNING = "running"  # inside batch_fn
    STOPPED = "stopped"


@dataclass(frozen=True)
class BatcherStats:
    """A consistent snapshot of the batcher's counters."""

    batches_formed: int
    items_processed: int
    batch_size_histogram: dict[int, int]  # batch size -> number of batches of that size
    queue_depth: int
    max_queue_depth: int
    rejected: int
    cancelled: int
    worker_wakeups: int  # returns from Condition.wait(); stays put while idle
    worker_state: WorkerState


@dataclass
class _Pending(Generic[T, R]):
    item: T
    future: Future[R]
    enqueued_at: float  # time.monotonic()
    seq: int  # arrival order, for fairness across buckets


@dataclass
class _Counters:
    batches: int = 0
    items: int = 0
    histogram: Counter[int] = field(default_factory=Counter)
    max_depth: int = 0
    rejected: int = 0
    cancelled: int = 0
    wakeups: int = 0


class DynamicBatcher(Generic[T, R]):
    """Thread-safe dynamic batcher (see module docstring). Use as a context manager or ``close()``."""

    def __init__(
        self,
        batch_fn: Callable[[list[T]], Sequence[R]],
        config: DynamicBatching | None = None,
        *,
        length_fn: Callable[[T], int] | None = None,
        name: str = "dynamic-batcher",
    ) -> None:
        self.config = config or default_batching()
        self._batch_fn = batch_fn
        self._length_fn = length_fn
        buckets = self.config.bucket_boundaries if length_fn else ()
        self._boundaries = list(buckets)
        self._queues: list[deque[_Pending[T, R]]] = [deque() for _ in range(len(buckets) + 1)]
        self._depth = 0
        self._seq = 0
        self._closed = False
        self._state = WorkerState.IDLE
        self._counters = _Counters()
        self._cond = threading.Condition()
        self._idle = threading.Event()  # set while the worker is parked in its untimed wait
        self._worker = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()

    # ---- producer side -------------------------------------------------------------------

    def submit(self, item: T) -> Future[R]:
        """Queue one item; raises ``QueueFull`` or ``BatcherClosed`` without queueing it."""
        return self.submit_many([item])[0]

    def submit_many(self, items: Sequence[T]) -> list[Future[R]]:
        """Queue all items or none (one request's inputs are admitted together)."""
        lengths = [self._length_fn(it) for it in items] if self._length_fn else [0] * len(items)
        with self._cond:
            if self._closed:
                raise BatcherClosed("batcher is closed")
            if self._depth + len(items) > self.config.max_queue_size:
                self._counters.rejected += len(items)
                raise QueueFull(
                    f"queue full ({self._depth} queued, max_queue_size={self.config.max_queue_size})"
                )
            now = time.monotonic()
            futures: list[Future[R]] = []
            for item, length in zip(items, lengths, strict=True):
                fut: Future[R] = Future()
                self._queues[self._bucket(length)].append(_Pending(item, fut, now, self._seq))
                self._seq += 1
                futures.append(fut)
            self._depth += len(items)
            self._counters.max_depth = max(self._counters.max_depth, self._depth)
            self._cond.notify()
        return futures

    def close(self, timeout: float | None = None) -> None:
        """Stop accepting work, fail queued items with ``BatcherClosed``, join the worker."""
        with self._cond:
            self._closed = True
            pending = [p for q in self._queues for p in q]
            for q in self._queues:
                q.clear()
            self._depth = 0
            self._cond.notify()
        for p in pending:
            if p.future.set_running_or_notify_cancel():
                p.future.set_exception(BatcherClosed("batcher closed before the item ran"))
        self._worker.join(timeout)

    def __enter__(self) -> DynamicBatcher[T, R]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- observation ---------------------------------------------------------------------

    def stats(self) -> BatcherStats:
        with self._cond:
            c = self._counters
            return BatcherStats(
                batches_formed=c.batches,
                items_processed=c.items,
                batch_size_histogram=dict(sorted(c.histogram.items())),
                queue_depth=self._depth,
                max_queue_depth=c.max_depth,
                rejected=c.rejected,
                cancelled=c.cancelled,
                worker_wakeups=c.wakeups,
                worker_state=self._state,
            )

    def worker_cpu_seconds(self) -> float:
        """CPU time the worker thread has used (Linux per-thread clock; NaN where unavailable)."""
        try:
            clock = time.pthread_getcpuclockid(self._worker.ident)  # type: ignore[arg-type]
            return time.clock_gettime(clock)
        except (AttributeError, OSError, TypeError):
            return float("nan")

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the worker is parked in its untimed wait (nothing queued, nothing running)."""
        return self._idle.wait(timeout)

    # ---- worker --------------------------------------------------------------------------

    def _bucket(self, length: int) -> int:
        return bisect.bisect_left(self._boundaries, length)

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._execute(batch)

    def _next_batch(self) -> list[_Pending[T, R]] | None:
        """Wait (without spinning) until a batch is due; pop it. None once closed."""
        with self._cond:
            while True:
                if self._closed:
                    self._state = WorkerState.STOPPED
                    return None
                if self._depth == 0:
                    self._state = WorkerState.IDLE
                    self._idle.set()
                    self._cond.wait()  # untimed: an idle batcher costs no CPU
                    self._idle.clear()
                    self._counters.wakeups += 1
                    continue
                bucket, wait_s = self._due_bucket(time.monotonic())
                if bucket is not None:
                    self._state = WorkerState.RUNNING
                    return self._pop(bucket)
                self._state = WorkerState.WAITING
                self._cond.wait(wait_s)
                self._counters.wakeups += 1

    def _due_bucket(self, now: float) -> tuple[int | None, float]:
        """(bucket to dispatch now, or None and how long until the oldest item is due)."""
        heads = [(q[0].seq, i) for i, q in enumerate(self._queues) if q]
        full = [(seq, i) for seq, i in heads if len(self._queues[i]) >= self.config.max_num_seqs]
        if full:
            return min(full)[1], 0.0
        _, oldest = min(heads)
        due_at = self._queues[oldest][0].enqueued_at + self.config.max_delay_ms / 1000.0
        if now >= due_at:
            return oldest, 0.0
        return None, due_at - now

    def _pop(self, bucket: int) -> list[_Pending[T, R]]:
        """Take up to max_num_seqs items of ``bucket``, dropping cancelled futures."""
        queue, batch = self._queues[bucket], list[_Pending[T, R]]()
        while queue and len(batch) < self.config.max_num_seqs:
            p = queue.popleft()
            self._depth -= 1
            if p.future.set_running_or_notify_cancel():
                batch.append(p)
            else:
                self._counters.cancelled += 1
        return batch

    def _execute(self, batch: list[_Pending[T, R]]) -> None:
        if not batch:
            return
        try:
            results = self._batch_fn([p.item for p in batch])
            if len(results) != len(batch):
                raise RuntimeError(
                    f"batch_fn returned {len(results)} results for {len(batch)} items"
                )
        except Exception as e:  # every waiter of the batch learns about the failure
            for p in batch:
                p.future.set_exception(e)
        else:
            for p, r in zip(batch, results, strict=True):
                p.future.set_result(r)
        with self._cond:
            self._counters.batches += 1
            self._counters.items += len(batch)
            self._counters.histogram[len(batch)] += 1


def __getattr__(name: str) -> Any:
    if name == "DynamicBatchingConfig":  # documented before 0.2: the settings are the stage now
        import warnings

        warnings.warn("DynamicBatchingConfig is the batching=dynamic stage now: "
                      "inferflow.stages.batching.DynamicBatching (max_batch_size -> max_num_seqs)",
                      DeprecationWarning, stacklevel=2)
        return _dynamic_batching_config
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dynamic_batching_config(max_batch_size: int = 32, max_delay_ms: float = 2.0,
                             max_queue_size: int = 1024,
                             bucket_boundaries: Sequence[int] = (16, 32, 64, 128, 256, 512),
                             ) -> DynamicBatching:
    return DynamicBatching(max_num_seqs=max_batch_size, max_delay_ms=max_delay_ms,
                           max_queue_size=max_queue_size, bucket_boundaries=list(bucket_boundaries))
