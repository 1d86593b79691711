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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from inferflow.config.base import ConfigError, typed_config
from inferflow.config.schema import SLOTS, LoadMode, ModelConfig, ModelEntryConfig


@dataclass(frozen=True)
class RepositoryEntry:
    """One served model version: ``config`` is the full config of its serving graph, ``model``
    its typed ``model`` node."""

    key: str  # its key under ``models:`` ("" for the top-level model served alone)
    config: dict[str, Any]
    load: LoadMode
    model: ModelConfig


def _merge_slot(base: Any, override: Any) -> Any:
    """``override`` merged onto ``base``; a different ``_target_`` replaces ``base``."""
    if base is None or not isinstance(override, Mapping) or not isinstance(base, Mapping):
        return override
    target = override.get("_target_")
    if target is not None and target != base.get("_target_"):
        return dict(override)
    merged = OmegaConf.merge(OmegaConf.create(dict(base)), OmegaConf.create(dict(override)))
    return OmegaConf.to_container(merged, resolve=True)


def plain_dict(node: DictConfig) -> dict[str, Any]:
    """``node`` as plain picklable data: resolved, enums as strings, string keys."""
    data = OmegaConf.to_container(node, resolve=True, enum_to_str=True)
    assert isinstance(data, dict)
    return {str(k): v for k, v in data.items()}


def repository_entries(config: DictConfig | Mapping[str, Any]) -> list[RepositoryEntry]:
    """The served entries of a composed config, in config order; ``ConfigError`` naming the key
    for a bad entry, an on-demand embedding model or a ``name@version`` served twice."""
    base = plain_dict(config if isinstance(config, DictConfig) else OmegaConf.create(dict(config)))
    nodes = dict(base.pop("models", None) or {})
    if not nodes:
        model = typed_config(ModelConfig, base.get("model"), "model")
        return [RepositoryEntry("", base, LoadMode.eager, model)]
    entries: list[RepositoryEntry] = []
    seen: dict[str, str] = {}
    for key, node in nodes.items():
        typed: ModelEntryConfig = typed_config(ModelEntryConfig, node, f"models.{key}")
        full = {k: copy.deepcopy(v) for k, v in base.items() if k != "extra_models"}
        if typed.model is not None:
            full["model"] = plain_dict(OmegaConf.structured(typed.model))
        for slot in SLOTS:  # (ModelEntryConfig has one field per slot)
            override = getattr(typed, slot)
            if override is not None:
                full[slot] = _merge_slot(full.get(slot), override)
        model = typed.model or typed_config(ModelConfig, full["model"], "model")
        entry = RepositoryEntry(str(key), full, LoadMode(typed.load), model)
        if model.is_embedding and entry.load is LoadMode.on_demand:
            raise ConfigError(
                f"models.{key}.load: embedding models are loaded in every API process at "
                "start-up; on_demand applies to LLMs",
                f"models.{key}.load",
            )
        identity = model.model_id
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
    llms = [e for e in entries if not e.model.is_embedding]
    for entry in llms if len(llms) > 1 else []:
        executor = entry.config.get("executor")
        if isinstance(executor, dict) and str(executor.get("kv_cache_memory")) == "auto":
            executor["kv_cache_memory"] = f"auto/{len(llms)}"
    return entries


def llm_entries(config: DictConfig | Mapping[str, Any]) -> list[RepositoryEntry]:
    return [e for e in repository_entries(config) if not e.model.is_embedding]


def embedding_entries(config: DictConfig | Mapping[str, Any]) -> list[ModelConfig]:
    """The repository's embedding entries as typed ``ModelConfig``s (``extra_models`` style)."""
    return [e.model for e in repository_entries(config) if e.model.is_embedding and e.key]
