"""A request stage that sleeps: stage time must show up as the stage's span, not as queue."""

from __future__ import annotations

import time
from dataclasses import dataclass

from inferflow.stages.base import RequestStage, StageRequest


@dataclass
class Sleepy(RequestStage):
    seconds: float = 0.2

    def process(self, request: StageRequest) -> StageRequest:
        time.sleep(self.seconds)
        return request
