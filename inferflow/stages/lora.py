"""The ``lora`` slot: multi-LoRA serving (many PEFT adapters of the served base model).

Contract (:class:`LoraStage`): its fields are the engine's LoRA settings (vLLM's names);
:meth:`spec` is the engine's LoRA shape (:class:`~inferflow.lora.LoraSpec`, None when LoRA is
off). LoRA is *on* iff ``adapters`` is non-empty or ``allow_runtime_updates`` is true; otherwise
the engine is built exactly as without the slot (``~lora`` removes it).

- ``adapters``: NAME -> PATH of a PEFT adapter folder, loaded at start
  (``lora.adapters.sql=/adapters/sql``; a request selects one with ``model=NAME``);
- ``max_loras``: adapters resident in the engine at once (its slots; the adapters one step may
  mix); ``max_lora_rank``: the largest rank served (smaller ones are zero-padded, exactly);
- ``max_cpu_loras``: adapters kept loaded in host memory (LRU; evicted ones are re-read from
  disk); null = max(max_loras, number of adapters);
- ``target_modules``: the projections the engine gives LoRA inputs (an adapter may target a
  subset); fewer targets make every step cheaper;
- ``allow_runtime_updates``: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
  (``LLMEngine.load_lora`` / ``unload_lora``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from inferflow.lora.adapter import LORA_TARGETS, LoraSpec
from inferflow.stages.engine_slot import EngineStage


def check_adapter_name(name: str, field_name: str = "adapters") -> None:
    """Refuse a name no request could select (empty, blank, or with ``@``: ``name@version``
    pins a model version)."""
    if not name or name != name.strip() or "@" in name or "/" in name:
        raise ValueError(f"{field_name}: an adapter name must be non-empty, without surrounding "
                         f"spaces, '@' or '/', got {name!r}")


@dataclass
class LoraStage(EngineStage):
    """The ``lora`` slot (see the module docstring)."""

    kind: ClassVar[str] = "lora"

    adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    allow_runtime_updates: bool = False

    def __post_init__(self) -> None:
        self.adapters = {str(k): str(v) for k, v in dict(self.adapters).items()}
        for name, path in self.adapters.items():
            check_adapter_name(name, f"adapters.{name}")
            if not path.strip():
                raise ValueError(f"adapters.{name}: needs the path of a PEFT adapter folder")
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be >= max_loras ({self.max_loras}), got "
                             f"{self.max_cpu_loras}")
        targets = [str(t) for t in self.target_modules]
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"target_modules: {', '.join(unknown)} cannot be served; allowed: "
                             f"{', '.join(LORA_TARGETS)}")
        if not targets:
            raise ValueError("target_modules: needs at least one projection")
        if len(set(targets)) != len(targets):
            raise ValueError(f"target_modules: lists a projection twice: {targets}")
        self.target_modules = targets

    @property
    def enabled(self) -> bool:
        """LoRA is on: adapters at start, or adapters may be loaded at run time."""
        return bool(self.adapters) or self.allow_runtime_updates

    @property
    def cpu_loras(self) -> int:
        """Adapters kept loaded in host memory (``max_cpu_loras``, or its default)."""
        if self.max_cpu_loras is not None:
            return self.max_cpu_loras
        return max(self.max_loras, len(self.adapters))

    def spec(self) -> LoraSpec | None:
        """The engine's LoRA shape (None: LoRA off, the engine is built without it); the
        targets in :data:`~inferflow.lora.LORA_TARGETS` order."""
        if not self.enabled:
            return None
        targets = tuple(t for t in LORA_TARGETS if t in self.target_modules)
        return LoraSpec(self.max_loras, self.max_lora_rank, targets)
