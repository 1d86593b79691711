"""Which adapter sits in which of the engine's ``max_loras`` slots.

An engine built with a :class:`LoraSpec` holds ``S = max_loras`` adapter slots in its stacked
``A_all`` / ``B_all`` weights; :class:`LoraSlots` makes a step's adapters resident before the step
runs: an adapter already in a slot stays there, a missing one is written (``set_lora``) into a
free slot, else into the least recently used slot that no adapter of this step (and, where the
caller says so, no running request) needs. Writing a slot is an in-place copy into the engine's
weights: no rebuild, and the other slots keep serving.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from inferflow.lora.adapter import LoraAdapter, LoraError, LoraSpec
from inferflow.lora.registry import LoraRegistry


class LoraRunner(Protocol):
    """The engine side (both runners implement it)."""

    lora_spec: LoraSpec | None  # None: engine built without LoRA

    def set_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        """Write adapter's A/B (zero-padded to R) into slot (0 <= slot < S) in place, and
        remember its scaling; None clears the slot. No rebuild, no rebinding."""


@dataclass
class _Resident:
    name: str
    version: int  # the registry's version of ``name`` written into the slot
    last_used: int  # the assign() call that last needed it


class LoraSlots:
    """The engine's adapter slots (used from the engine's thread only).

    ``assign(names)`` returns each name's slot, loading missing adapters from ``registry``
    (its host LRU, else the adapter's folder); ``loads_into_engine`` counts the slot writes. A
    slot's adapter is stale once its name was removed and added again (another folder): it is
    never served again. A removed name keeps its slot (requests already running on it finish)
    until the slot is needed or ``free(name)`` clears it.
    """

    def __init__(self, runner: LoraRunner, registry: LoraRegistry) -> None:
        if runner.lora_spec is None:
            raise ValueError("the engine was built without LoRA (lora_spec is None)")
        self.runner, self.registry = runner, registry
        self.num_slots = runner.lora_spec.max_loras
        self._slots: list[_Resident | None] = [None] * self.num_slots
        self._tick = 0
        self.loads_into_engine = 0

    def assign(self, names: Collection[str], running: Collection[str] = ()) -> dict[str, int]:
        """Make every adapter of ``names`` resident; returns name -> slot.

        A missing adapter takes the slot of its own older version, else a free slot, else a slot
        whose adapter is gone (removed and in neither ``names`` nor ``running``, or replaced by a
        newer add), else the least recently used slot whose adapter is in neither ``names`` nor
        ``running`` (``running``: adapters of requests that run but are not in this step), else
        the least recently used one not in ``names``.
        Raises ValueError when ``names`` outnumber the slots, :class:`LoraError` (``model``) for
        a name that is not loaded and not resident."""
        wanted = set(names)
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} adapters in one step, the engine has "
                             f"{self.num_slots} slots (lora.max_loras)")
        self._tick += 1
        out: dict[str, int] = {}
        for name in sorted(wanted):
            slot = self._find(name)
            if slot is None:
                slot = self._load(name, wanted, set(running))
            resident = self._slots[slot]
            assert resident is not None
            resident.last_used = self._tick
            out[name] = slot
        return out

    def _find(self, name: str) -> int | None:
        """The slot serving ``name``: its current version, or its last one once removed."""
        current = self.registry.version(name)
        for slot, resident in enumerate(self._slots):
            if resident is not None and resident.name == name and current in (None, resident.version):
                return slot
        return None

    def _is_dead(self, resident: _Resident, needed: set[str]) -> bool:
        """Removed and needed by no request, or replaced by a newer add of its name."""
        current = self.registry.version(resident.name)
        if current is None:
            return resident.name not in needed
        return current != resident.version

    def _victim(self, name: str, wanted: set[str], running: set[str]) -> int:
        live = [(s, r) for s, r in enumerate(self._slots) if r is not None]
        for slot, resident in live:  # an older version of this name: never served again
            if resident.name == name:
                return slot
        if len(live) < self.num_slots:
            return self._slots.index(None)
        dead = [s for s, r in live if self._is_dead(r, wanted | running)]
        if dead:
            return dead[0]
        for spare in (wanted | running, wanted):
            candidates = [(r.last_used, s) for s, r in live if r.name not in spare]
            if candidates:
                return min(candidates)[1]
        raise ValueError("no engine slot is free of this step's adapters")  # len(wanted) > S

    def _load(self, name: str, wanted: set[str], running: set[str]) -> int:
        try:
            adapter, version = self.registry.get_versioned(name)
        except KeyError:
            raise LoraError("model", f"adapter {name!r} is not loaded") from None
        slot = self._victim(name, wanted, running)
        self.runner.set_lora(slot, adapter)
        self.loads_into_engine += 1
        self._slots[slot] = _Resident(name, version, self._tick)
        return slot

    def free(self, name: str) -> None:
        """Clear the slot(s) holding ``name`` (after its unload, once no request uses it)."""
        for slot, resident in enumerate(self._slots):
            if resident is not None and resident.name == name:
                self.runner.set_lora(slot, None)
                self._slots[slot] = None

    def resident(self) -> dict[str, int]:
        """name -> slot of the adapters in the engine now (stale ones included)."""
        return {r.name: s for s, r in enumerate(self._slots) if r is not None}
