"""Which embedding models a serving graph hosts: ``model`` itself when ``model.task=embed``,
plus every ``extra_models`` entry (all ``task=embed`` in this version)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from inferflow.config.base import ConfigError, typed_config
from inferflow.config.schema import ModelConfig, ModelTask
from inferflow.embeddings.dynamic_batcher import default_batching
from inferflow.graph.repository import embedding_entries
from inferflow.models.lookup import resolve_model
from inferflow.stages.batching import DynamicBatching

if TYPE_CHECKING:
    from inferflow.graph.build import ServingGraph


@dataclass(frozen=True)
class EmbeddingModelSpec:
    """One served embedding model version (picklable: built before the API process forks)."""

    name: str
    version: str
    path: str
    weight: float
    batching: DynamicBatching

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.version}"


def batching_config(graph: ServingGraph) -> DynamicBatching:
    """The ``batching=dynamic`` stage when chosen, else the dynamic batcher's defaults."""
    slot = graph.engine_slots.get("batching")
    return slot if isinstance(slot, DynamicBatching) else default_batching()


def _entry(key: str, node: object) -> ModelConfig:
    entry = typed_config(ModelConfig, node, f"extra_models.{key}")
    assert isinstance(entry, ModelConfig)
    if not entry.is_embedding:
        raise ConfigError(
            f"extra_models.{key}.task: only embed models can be served beside the main model "
            f"(got {ModelTask(entry.task).value})",
            f"extra_models.{key}.task",
        )
    return entry


def embedding_specs(graph: ServingGraph) -> list[EmbeddingModelSpec]:
    """The graph's embedding model versions, main model first, then ``extra_models`` and the
    repository's embedding entries; ``ConfigError`` for a bad entry
    or two entries with the same ``name@version``."""
    batching = batching_config(graph)
    entries: list[ModelConfig] = [graph.model] if graph.model.is_embedding else []
    extra = graph.config.get("extra_models") or {}
    if isinstance(extra, DictConfig):
        entries += [_entry(str(k), v) for k, v in extra.items()]
    entries += embedding_entries(graph.config)  # the repository's (``models:``)
    specs: list[EmbeddingModelSpec] = []
    seen: set[str] = set()
    for entry in entries:
        path, name = resolve_model(entry)
        spec = EmbeddingModelSpec(name, str(entry.version), str(path), entry.weight, batching)
        model_id = spec.model_id
        if model_id in seen:
            raise ConfigError(f"extra_models: {model_id} is served twice", "extra_models")
        seen.add(model_id)
        specs.append(spec)
    return specs
