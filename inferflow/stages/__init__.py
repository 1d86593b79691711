"""Serving-graph stages: the contract of each kind and the built-in implementations. Above the
core: a stage may import ``config/``, ``models/``, ``scheduling/``, ``sampling/`` and ``runtimes/``;
nothing of ``engine/``, ``graph/`` or ``server/`` (they assemble and drive the stages).

- Request stages (``base.RequestStage``), per request before the engine: ``validator``,
  ``tokenizer`` and plugin stages.
- Engine-side stages (``engine_slot.EngineStage``), the engine's components: ``batching`` (the
  scheduler's budgets and admission order), ``cache`` (prefix cache), ``executor`` (owns the runner
  that runs the model), ``detokenizer``.
- Response stages (``response.ResponseStage``), per request on the engine's output.
- ``registry.py``: the built-in options of each slot group (``conf/<slot>/<option>.yaml``) and
  their Hydra schemas.
"""

from typing import Any

from inferflow.stages.base import (
    PassThroughStage,
    RequestStage,
    StageContext,
    StageError,
    StageRequest,
)
from inferflow.stages.engine_slot import EngineStage
from inferflow.stages.response import ResponseDelta, ResponseStage

__all__ = [
    "EngineStage",
    "PassThroughStage",
    "RequestStage",
    "ResponseDelta",
    "ResponseStage",
    "StageContext",
    "StageError",
    "StageRequest",
]


def __getattr__(name: str) -> Any:
    if name == "EngineSlot":  # the name before 0.2; warns
        from inferflow.stages import engine_slot

        return engine_slot.EngineSlot
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
