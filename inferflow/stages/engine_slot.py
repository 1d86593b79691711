"""Contract of the engine-side slots: ``cache``, ``batching``, ``executor``, ``detokenizer``.

Engine-side slots do not run per request; each is a small typed config object (a dataclass
built from its own config keys) that *contributes* settings to an :class:`EngineSpec`.
``ServingGraph.create_engine()`` asks every present slot, in pipeline order, then turns the spec
into ``EngineConfig`` + ``SchedulerConfig`` and the ``LLMEngine``. A slot may also put request
stages on the request path (e.g. a priority batching policy that tags requests with a priority).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from inferflow.stages.base import RequestStage


@dataclass
class EngineSpec:
    """Keyword arguments being assembled for the engine.

    - ``engine``: fields of ``inferflow.engines.config.EngineConfig`` (executor settings);
    - ``scheduler``: fields of ``inferflow.scheduling.config.SchedulerConfig`` (batching, cache);
    - ``shared``: the physical layout both configs carry and that must agree (``max_slots``,
      ``max_model_len``, ``block_size``, ``num_blocks``);
    - ``detokenizer``: keyword arguments of ``inferflow.sampling.detokenizer.IncrementalDetokenizer``
      besides the tokenizer and the stop strings;
    - ``backend`` names the compiled-engine runtime (``onnxruntime`` or ``tensorrt``) and
      ``backend_options`` holds runtime-specific settings (e.g. a GPU ``device_id``).
    """

    backend: str = "onnxruntime"
    backend_options: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    shared: dict[str, Any] = field(default_factory=dict)
    detokenizer: dict[str, Any] = field(default_factory=dict)


class EngineSlot(ABC):
    """A typed config object that shapes the engine.

    Contract: subclasses are dataclasses whose fields are the slot's config keys (the graph
    builder validates the config against those fields, so a bad value or an unknown key is a
    clear error). ``contribute`` only writes into the spec (no I/O, no imports of heavy runtimes):
    it runs in every process that builds an engine. ``kind`` names the slot the class fills.
    """

    kind: ClassVar[str] = ""

    @abstractmethod
    def contribute(self, spec: EngineSpec) -> None:
        """Write this slot's settings into ``spec``."""

    def request_stages(self) -> list[RequestStage]:
        """Request stages this slot needs on the request path (placed at the slot's position)."""
        return []
