"""Scheduling: block pool -> per-request KV manager -> scheduler (pure data structures). Core
layer: imports ``config/``, ``models/`` (the KV budget reads the model's shape), ``outputs`` and
``sampling_params``; nothing of ``stages/``, ``engine/`` or ``server/``.

The engine step that drives it is ``inferflow.engine.step.step``:
``schedule() -> executor.execute(plan) -> update()``.
"""

from inferflow.scheduling.config import SchedulerConfig, SchedulerConfigError
from inferflow.scheduling.layout import KVLayout
from inferflow.scheduling.request import Request, RequestStatus
from inferflow.scheduling.scheduler import Scheduler
from inferflow.scheduling.updates import SchedulerStats, StepUpdate

__all__ = [
    "KVLayout",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerStats",
    "StepUpdate",
]
