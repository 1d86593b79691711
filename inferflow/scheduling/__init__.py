"""Scheduling: block pool -> per-request KV manager -> scheduler policy (pure data structures).

The engine step is ``engine_loop.step``: ``schedule() -> executor.execute(plan) -> update()``.
"""

from inferflow.scheduling.config import SchedulerConfig, SchedulerConfigError
from inferflow.scheduling.engine_loop import Executor, step
from inferflow.scheduling.request import Request, RequestStatus
from inferflow.scheduling.scheduler import Scheduler
from inferflow.scheduling.updates import RequestUpdate, SchedulerStats

__all__ = [
    "Executor",
    "Request",
    "RequestStatus",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerStats",
    "step",
]
