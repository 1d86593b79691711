"""The model repository: which models one server serves (``models:`` in the config).

::

    models:
      chat:    {model: {path: /models/chat, name: chat}}
      chat_v2: {model: {path: /models/chat-v2, name: chat, version: "2", weight: 0.1}}
      small:   {model: {builtin: tiny_llama, name: small}, load: on_demand,
                executor: {precision: int8}}
      minilm:  {model: {builtin: minilm, task: embed}}

Without ``models`` the server serves ``model`` alone (one eager entry, as always). With it, the
server serves exactly its entries; an entry without ``model`` serves the top-level ``model``.
An entry's slot keys are merged onto the top-level slot (``executor: {precision: int8}``), or
replace it when they name another ``_target_``. Every LLM entry becomes its own serving graph
and engine worker process; embedding entries (``task: embed``) join the encoders of the API
processes, like ``extra_models``. Entries sharing a ``model.name`` are versions of one model:
``name@version`` pins one, a plain ``name`` draws one by ``weight`` (the canary split).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from inferflow.config import (
    SLOTS,
    ConfigError,
    LoadMode,
    ModelConfig,
    ModelEntryConfig,
    ModelTask,
)

ENTRY_SLOTS = SLOTS  # every slot an entry may override (ModelEntryConfig has one field each)


@dataclass(frozen=True)
class RepositoryEntry:
    """One served model version: ``config`` is the full config of its serving graph."""

    key: str  # its key under ``models:`` ("" for the top-level model served alone)
    config: dict[str, Any]
    load: LoadMode

    @property
    def model(self) -> dict[str, Any]:
        return dict(self.config["model"])

    @property
    def is_embedding(self) -> bool:
        return ModelTask(self.model.get("task", "generate")) is ModelTask.embed


def _typed_entry(key: str, node: Any) -> ModelEntryConfig:
    from inferflow.graph import typed_config

    entry = typed_config(ModelEntryConfig, node, f"models.{key}")
    assert isinstance(entry, ModelEntryConfig)
    return entry


def _merge_slot(base: Any, override: Any) -> Any:
    """``override`` merged onto ``base``; a different ``_target_`` replaces ``base``."""
    if base is None or not isinstance(override, Mapping) or not isinstance(base, Mapping):
        return override
    target = override.get("_target_")
    if target is not None and target != base.get("_target_"):
        return dict(override)
    merged = OmegaConf.merge(OmegaConf.create(dict(base)), OmegaConf.create(dict(override)))
    return OmegaConf.to_container(merged, resolve=True)


def _model_dict(model: ModelConfig) -> dict[str, Any]:
    node = OmegaConf.structured(model)
    plain = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    assert isinstance(plain, dict)
    return {str(k): v for k, v in plain.items()}


def repository_entries(config: DictConfig | Mapping[str, Any]) -> list[RepositoryEntry]:
    """The served entries of a composed config, in config order; ``ConfigError`` naming the key
    for a bad entry, an on-demand embedding model or a ``name@version`` served twice."""
    container = OmegaConf.to_container(
        config if isinstance(config, DictConfig) else OmegaConf.create(dict(config)),
        resolve=True,
        enum_to_str=True,
    )
    assert isinstance(container, dict)
    base: dict[str, Any] = {str(k): v for k, v in container.items()}  # config keys are strings
    nodes = dict(base.pop("models", None) or {})
    if not nodes:
        return [RepositoryEntry("", base, LoadMode.eager)]
    entries: list[RepositoryEntry] = []
    seen: dict[str, str] = {}
    for key, node in nodes.items():
        typed = _typed_entry(str(key), node)
        full = {k: copy.deepcopy(v) for k, v in base.items() if k != "extra_models"}
        if typed.model is not None:
            full["model"] = _model_dict(typed.model)
        for slot in ENTRY_SLOTS:
            override = getattr(typed, slot)
            if override is not None:
                full[slot] = _merge_slot(full.get(slot), override)
        entry = RepositoryEntry(str(key), full, LoadMode(typed.load))
        if entry.is_embedding and entry.load is LoadMode.on_demand:
            raise ConfigError(
                f"models.{key}.load: embedding models are loaded in every API process at "
                "start-up; on_demand applies to LLMs",
                f"models.{key}.load",
            )
        model = entry.model
        identity = f"{model.get('name') or model.get('path') or model.get('builtin')}@" + str(
            model.get("version", "1")
        )
        if identity in seen:
            raise ConfigError(
                f"models.{key}: {identity} is already served by models.{seen[identity]} "
                "(give one of them another model.version)",
                f"models.{key}.model.version",
            )
        seen[identity] = str(key)
        entries.append(entry)
    return _share_kv_memory(entries)


def _share_kv_memory(entries: list[RepositoryEntry]) -> list[RepositoryEntry]:
    """N LLMs on one machine: each engine's ``kv_cache_memory: auto`` becomes ``auto/N`` (an
    N-th of the memory one engine alone would take); explicit sizes stay."""
    llms = [e for e in entries if not e.is_embedding]
    for entry in llms if len(llms) > 1 else []:
        executor = entry.config.get("executor")
        if isinstance(executor, dict) and str(executor.get("kv_cache_memory")) == "auto":
            executor["kv_cache_memory"] = f"auto/{len(llms)}"
    return entries


def llm_entries(config: DictConfig | Mapping[str, Any]) -> list[RepositoryEntry]:
    return [e for e in repository_entries(config) if not e.is_embedding]


def embedding_entries(config: DictConfig | Mapping[str, Any]) -> list[ModelConfig]:
    """The repository's embedding entries as typed ``ModelConfig``s (``extra_models`` style)."""
    from inferflow.graph import typed_config

    return [
        typed_config(ModelConfig, entry.model, f"models.{entry.key}.model")
        for entry in repository_entries(config)
        if entry.is_embedding and entry.key
    ]


def build_entry_graph(entry: RepositoryEntry) -> Any:
    """The entry's ``ServingGraph``; its config errors name the entry's key."""
    from inferflow.graph import build_graph

    try:
        return build_graph(entry.config)
    except ConfigError as exc:
        if not entry.key:
            raise
        key = f"models.{entry.key}.{exc.key}" if exc.key else f"models.{entry.key}"
        raise ConfigError(f"models.{entry.key}: {exc}", key) from None


def check_repository(graph: Any, check_llm: Callable[[Any], list[str]]) -> list[str]:
    """``task=check`` of a repository: each LLM entry's graph built and probed by
    ``check_llm`` (the embedding entries are listed by the caller)."""
    entries = llm_entries(graph.config)
    lines = [f"model repository: {len(entries)} LLM(s)"]
    for entry in entries:
        entry_graph = build_entry_graph(entry)
        entry_graph.check_engine_settings()
        model = entry_graph.model
        precision = getattr(entry_graph.executor, "precision", None)
        lines.append(
            f"models.{entry.key}: {entry_graph.model_name}@{model.version} weight={model.weight} "
            f"load={entry.load.value} executor={entry_graph.executor.backend}"
            + (f" {getattr(precision, 'value', precision)}" if precision is not None else "")
        )
        lines += [f"  {line}" for line in check_llm(entry_graph)]
    lines.append("the top-level slots each entry inherits:")
    return lines
