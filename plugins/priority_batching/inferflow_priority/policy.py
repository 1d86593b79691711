"""Priority batching: a scheduling policy (lower priority value first) plus a stage that assigns
priorities."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferflow.scheduling.policy import RequestQueue, SortedQueue, SortKey
from inferflow.scheduling.request import Request
from inferflow.stages.base import (
    ATTR_API_KEY_ID,
    ATTR_PRIORITY,
    ATTR_USER,
    RequestStage,
    StageRequest,
)
from inferflow.stages.batching import ContinuousBatching, SchedulingPolicy


@dataclass
class PriorityTagger(RequestStage):
    """Set ``attributes["priority"]`` from the tier of the request's API key or ``user``.

    The API key id wins over ``user`` (clients choose ``user`` freely). With
    ``allow_client_priority`` the client's own ``priority`` may only make it *less* urgent.
    """

    tiers: dict[str, int] = field(default_factory=dict)
    default_priority: int = 10
    allow_client_priority: bool = False

    def process(self, request: StageRequest) -> StageRequest:
        attrs = request.attributes
        priority = self.default_priority
        for key in (attrs.get(ATTR_API_KEY_ID), attrs.get(ATTR_USER)):
            if key is not None and str(key) in self.tiers:
                priority = self.tiers[str(key)]
                break
        requested = attrs.get(ATTR_PRIORITY)
        if self.allow_client_priority and isinstance(requested, int):
            priority = max(priority, requested)
        attrs[ATTR_PRIORITY] = priority
        return request


@dataclass
class PriorityBatching(ContinuousBatching):
    """Continuous batching admitting lower ``priority`` values first (then earlier arrival) and
    preempting the least urgent first."""

    policy: SchedulingPolicy = SchedulingPolicy.priority
    tiers: dict[str, int] = field(default_factory=dict)
    default_priority: int = 10
    allow_client_priority: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if SchedulingPolicy(self.policy) is not SchedulingPolicy.priority:
            raise ValueError(
                "policy: batching=priority always uses 'priority' (use batching=continuous for fcfs)"
            )

    def sort_key(self, request: Request, seq: int) -> SortKey:
        return (request.priority, request.arrival_time, seq)

    def make_queue(self, keys: dict[str, SortKey]) -> RequestQueue:
        return SortedQueue(keys)

    def request_stages(self) -> list[RequestStage]:
        tagger = PriorityTagger(dict(self.tiers), self.default_priority, self.allow_client_priority)
        tagger.name = "priority_tagger"
        return [tagger]
