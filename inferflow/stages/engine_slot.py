"""Contract shared by the engine-side stages: ``cache``, ``batching``, ``executor``, ``detokenizer``.

Each engine-side slot holds one component chosen by ``_target_``, like the request stages. The
class is a dataclass whose fields are the slot's config keys (the graph builder validates the
config against them, so a bad value or an unknown key is a clear error), and it *is* the
component: the batching stage is the scheduling policy, the cache stage makes the prefix cache,
the executor stage runs the model, the detokenizer stage turns tokens into text. Each kind has
its own abstract class with the contract in its docstring:

=============  ==========================================  ==================================
slot           contract                                    built-in implementations
=============  ==========================================  ==================================
``batching``   :class:`~inferflow.stages.batching.BatchingStage`    none, static, dynamic, continuous
``cache``      :class:`~inferflow.stages.cache.CacheStage`          prefix, none
``executor``   :class:`~inferflow.stages.executor.ExecutorStage`    onnxruntime, tensorrt
``detokenizer`` :class:`~inferflow.stages.detokenizer.DetokenizerStage`  default
=============  ==========================================  ==================================

``__init__`` must stay cheap (no I/O, no heavy imports): the graph is rebuilt in every process.
Expensive work happens when the engine is created, in the engine worker only.
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

from inferflow.stages.base import RequestStage


class EngineStage(ABC):  # noqa: B024 - a marker base; each kind's subclass is abstract
    """Base of the engine-side stages. ``kind`` names the slot the class fills."""

    kind: ClassVar[str] = ""

    def request_stages(self) -> list[RequestStage]:
        """Request stages this component needs on the request path, placed at its slot's
        position (e.g. a priority policy's stage that tags requests with a priority)."""
        return []

    def settings(self) -> dict[str, Any]:
        """The values in effect, as plain data (``/version`` shows them; tests read them back)."""
        import dataclasses

        if not dataclasses.is_dataclass(self):
            return {}
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self) if f.init}


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)  # enums
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def __getattr__(name: str) -> Any:
    if name == "EngineSlot":
        import warnings

        warnings.warn(
            "inferflow.stages.engine_slot.EngineSlot is now EngineStage (each slot kind has its "
            "own contract: BatchingStage, CacheStage, ExecutorStage, DetokenizerStage)",
            FutureWarning,
            stacklevel=2,
        )
        return EngineStage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
