"""Multi-LoRA on the server, host-independent: what the frontend and the engine worker both know
about one LLM's adapters.

``LoraServing`` is the ``lora`` config slot of one served LLM as plain data (it pickles into the
worker and is inherited by the API processes). LoRA is on for a model iff its ``lora.adapters``
is non-empty or ``lora.allow_runtime_updates`` is set (the engine's rule); otherwise the model
has no ``LoraServing`` and the server behaves as without LoRA.

The engine worker is the source of truth for which adapters exist (runtime loads and unloads
happen there): it publishes ``lora_state`` into the model's ``SharedState`` blob ``lora``
whenever it changes, and every API process routes ``model=ADAPTER`` and lists adapters from that
blob (``published_adapters``); before the worker first published (a model still loading) the
configured adapters stand in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from inferflow.server.shared_state import SharedState
from inferflow.stages.lora import LoraStage


@dataclass(frozen=True)
class LoraServing:
    """One LLM's ``lora`` settings the server needs: the configured adapters (NAME -> PATH),
    ``max_loras`` (adapters one engine step can mix) and whether adapters may be loaded and
    unloaded at run time (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``)."""

    adapters: dict[str, str] = field(default_factory=dict)
    max_loras: int = LoraStage.max_loras
    allow_runtime_updates: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LoraServing | None:
        """From a resolved plain config (``ServingGraph.to_container()``); None when the model
        serves no adapters (no ``lora`` slot, or no adapter and no runtime updates)."""
        section = config.get("lora")
        if not isinstance(section, Mapping):
            return None
        # the slot's own reading of its keys (defaults, checks, the rule for ``enabled``); a
        # null key (``lora.adapters=null``) takes the slot's default
        known = {f.name for f in fields(LoraStage) if f.init}
        stage = LoraStage(**{k: v for k, v in section.items() if k in known and v is not None})
        if not stage.enabled:
            return None
        adapters = {str(k): str(v) for k, v in stage.adapters.items()}
        return cls(adapters, stage.max_loras, stage.allow_runtime_updates)


def lora_state(
    adapters: Mapping[str, str],
    running: list[str],
    waiting: list[str],
    max_loras: int,
    loads: int,
    unloads: int,
    slot_loads: int = 0,
) -> dict[str, Any]:
    """The ``SharedState.lora`` blob the worker publishes: its adapters (name -> path), the
    adapters of running and waiting requests, ``max_loras`` and the engine's counters:
    ``loads`` (adapters read from disk: at start, runtime loads, re-reads after host-memory
    eviction), ``unloads`` (runtime unloads), ``slot_loads`` (adapters written into an engine
    slot)."""
    return {
        "adapters": [{"name": name, "path": path} for name, path in adapters.items()],
        "running": sorted(running),
        "waiting": sorted(waiting),
        "max_loras": max_loras,
        "loads": loads,
        "unloads": unloads,
        "slot_loads": slot_loads,
        "updated_at": time.time(),
    }


def published_adapters(shared: SharedState, lora: LoraServing | None) -> dict[str, str]:
    """The adapters a model serves now, name -> path: what its worker last published, else
    (not published yet, or the worker died) the configured ones; {} without LoRA."""
    if lora is None:
        return {}
    state = shared.lora()
    listed = state.get("adapters")
    if not isinstance(listed, list):
        return dict(lora.adapters)
    return {
        str(a["name"]): str(a.get("path", ""))
        for a in listed
        if isinstance(a, dict) and "name" in a
    }
