"""Scheduling policies: the order of the waiting queue, and who gets preempted.

A policy is one function, ``sort_key(request, seq)``: smaller keys are admitted first and
preempted last (the preemption victim is always the *last* running request in key order), plus
the queue that keeps waiting requests in that order. ``seq`` is the ``add_request`` order.

- ``fcfs``: order of ``add_request``;
- ``priority``: lower ``Request.priority`` first, then earlier ``arrival_time``, then
  ``add_request`` order.

The ``batching`` stages implement :class:`AdmissionOrder`, so a plugin decides admission order
(e.g. shortest prompt first) by overriding ``sort_key`` without touching the scheduler.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from inferflow.scheduling.request import Request

SortKey = tuple[float, ...]


class RequestQueue(Protocol):
    """The waiting queue. ``prepend`` puts a preempted request back at the front (in fcfs)."""

    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._q.append(request)

    def prepend(self, request: Request) -> None:
        self._q.appendleft(request)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, request: Request) -> None:
        self._q.remove(request)  # O(n), only on cancellation of a waiting request

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class SortedQueue:
    """Kept sorted by ``key``; a preempted request re-enters at its own rank (usually the front)."""

    def __init__(self, key: dict[str, SortKey]) -> None:
        self._key = key  # request_id -> sort key, owned by the scheduler
        self._keys: list[SortKey] = []
        self._reqs: list[Request] = []

    def add(self, request: Request) -> None:
        k = self._key[request.request_id]
        i = bisect.bisect_right(self._keys, k)
        self._keys.insert(i, k)
        self._reqs.insert(i, request)

    prepend = add

    def peek(self) -> Request:
        return self._reqs[0]

    def pop(self) -> Request:
        self._keys.pop(0)
        return self._reqs.pop(0)

    def remove(self, request: Request) -> None:
        i = self._reqs.index(request)
        del self._keys[i], self._reqs[i]

    def __len__(self) -> int:
        return len(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._reqs)


class AdmissionOrder(Protocol):
    """Service order of the scheduler (see the module docstring)."""

    def sort_key(self, request: Request, seq: int) -> SortKey:
        """Smaller is admitted first and preempted last; computed once, at ``add_request``."""
        ...

    def make_queue(self, keys: dict[str, SortKey]) -> RequestQueue:
        """The waiting queue; ``keys`` (request id -> sort key) is owned by the scheduler."""
        ...


def sort_key(policy: str, request: Request, seq: int) -> SortKey:
    """The built-in orders: ``priority``, else arrival (``fcfs``)."""
    if policy == "priority":
        return (request.priority, request.arrival_time, seq)
    return (seq,)


def make_queue(policy: str, keys: dict[str, SortKey]) -> RequestQueue:
    """The waiting queue of a built-in order: a deque for arrival order, else sorted."""
    return SortedQueue(keys) if policy == "priority" else FCFSQueue()
