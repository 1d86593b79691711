"""Serving-graph stages: contracts (``base``, ``engine_slot``) and the built-in implementations.

Request stages (run per request before the engine): ``validator``, ``tokenizer`` and plugin
stages. Engine-side slots (typed config objects that shape the engine): ``cache``,
``batching``, ``executor``, ``detokenizer``.
"""

from inferflow.stages.base import (
    PassThroughStage,
    RequestStage,
    StageContext,
    StageError,
    StageRequest,
)
from inferflow.stages.engine_slot import EngineSlot, EngineSpec

__all__ = [
    "EngineSlot",
    "EngineSpec",
    "PassThroughStage",
    "RequestStage",
    "StageContext",
    "StageError",
    "StageRequest",
]
