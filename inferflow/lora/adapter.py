"""A PEFT LoRA adapter as the engine uses it (``adapter_config.json`` + ``adapter_model.safetensors``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# the projections an adapter may target, in the order the engines apply them (PEFT's names)
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj")


class LoraError(ValueError):
    """An adapter that cannot be served here; ``field`` is the request or config field to name
    in a 400 (``lora_path``, ``lora_name``, ``model``, ``lora.adapters.NAME``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class LoraSpec:
    """The engine's LoRA shape, fixed when the engine is built (part of its cache key).

    ``max_loras`` slots (adapters resident in the engine at once, the adapters one step can mix),
    each of rank ``max_lora_rank`` (a smaller rank is zero-padded: exact), on ``targets`` (a
    subset of :data:`LORA_TARGETS`, in that order)."""

    max_loras: int
    max_lora_rank: int
    targets: tuple[str, ...] = LORA_TARGETS

    def cache_fields(self) -> dict[str, object]:
        return {"lora_max_loras": self.max_loras, "lora_max_rank": self.max_lora_rank,
                "lora_targets": ",".join(self.targets)}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, ready to be written into an engine slot.

    ``weights[(layer, target)] = (A, B)``: ``A`` (d_in, r) and ``B`` (r, d_out) float32, the
    transposes of PEFT's ``lora_A.weight`` (r, d_in) and ``lora_B.weight`` (d_out, r), so a
    target's output gains ``scaling * (x @ A @ B)``. A (layer, target) the adapter does not train
    is absent (its slot columns stay zero). ``scaling`` is ``lora_alpha / r`` (rsLoRA:
    ``lora_alpha / sqrt(r)``).
    """

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)
    base_model: str | None = None  # adapter_config.json's base_model_name_or_path

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())
