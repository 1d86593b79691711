"""Request priority, honestly: refused where the order ignores it, preemptive where it does not.

Convention (vLLM's): a *lower* ``Request.priority`` is served first; 0 is the default.

- ``honours_priority(order)``: does the admission order read ``Request.priority``? The built-in
  ``fcfs`` order does not, so a request with a non-default priority is refused there (HTTP 400
  naming ``priority``; ``LLMEngine.add_request`` raises ``RequestRejected("priority")``) rather
  than accepted and ignored. The built-in ``priority`` order does; an order that does not say
  (a plugin's own ``AdmissionOrder`` object) is trusted to.
- ``priority_victim``: under the built-in ``priority`` policy, when the head of the waiting
  queue lacks a slot or the KV blocks of its first chunk, the scheduler preempts the
  lowest-ranked running request if the head outranks it (a strictly lower priority value), one
  at a time until the head fits or nothing it outranks runs (vLLM's priority preemption). It
  does so by its usual path (recompute: the victim goes back to waiting with its output kept;
  a greedy continuation is unchanged), before it schedules the running requests, so no chunk
  of a victim is in the plan, and admission follows in the same step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from inferflow.scheduling.policy import AdmissionOrder, SortKey
from inferflow.scheduling.request import Request

PRIORITY_IGNORED = (
    "a non-default priority needs batching.policy=priority; the fcfs policy in use serves "
    "requests in arrival order and would ignore it"
)


def honours_priority(order: AdmissionOrder) -> bool:
    """Whether ``order`` reads ``Request.priority`` (its ``honours_priority``; True when it does
    not say: a plugin's order is trusted)."""
    return bool(getattr(order, "honours_priority", True))


def priority_victim(
    head: Request, running: Sequence[Request], key: Callable[[Request], SortKey]
) -> Request | None:
    """The running request to preempt for ``head`` (the waiting queue's first, which lacks a
    slot or blocks): the lowest-ranked one (largest ``key``) if ``head`` outranks it (a strictly
    lower priority value), else None."""
    victim = max(running, key=key, default=None)
    return victim if victim is not None and victim.priority > head.priority else None
