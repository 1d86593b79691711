"""The adapters a server knows (name -> PEFT folder) and the host-memory LRU of loaded ones."""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from inferflow.lora.adapter import LoraAdapter, LoraError, LoraSpec, load_peft_adapter

if TYPE_CHECKING:
    from inferflow.models.config import ModelArch


@dataclass(frozen=True)
class _Entry:
    path: Path
    version: int  # new on every add: a name re-added with another folder is another adapter
    field_name: str


class LoraRegistry:
    """Adapters by name for one base model ``arch`` served with ``spec``.

    ``add`` reads and checks an adapter at once (a bad folder is refused there, not at its first
    request); at most ``max_cpu_loras`` loaded adapters stay in host memory, least recently used
    evicted first, and ``get`` re-reads an evicted one from its folder. Counters: ``loads`` (reads
    from disk: each ``add`` and each re-read), ``unloads`` (``remove`` calls), ``host_evictions``.
    Thread-safe (the API's load/unload and the engine's step may call it concurrently).
    """

    def __init__(self, spec: LoraSpec, arch: ModelArch, max_cpu_loras: int) -> None:
        if max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be >= 1, got {max_cpu_loras}")
        self.spec, self.arch, self.max_cpu_loras = spec, arch, max_cpu_loras
        self._entries: dict[str, _Entry] = {}
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._next_version = 0
        self.loads = 0
        self.unloads = 0
        self.host_evictions = 0

    def add(self, name: str, path: Path | str, *, field_name: str = "lora_path") -> LoraAdapter:
        """Read and check the adapter at ``path`` and serve it as ``name``; returns it.
        Raises :class:`LoraError` (``field_name``) for a bad adapter, (``lora_name``) for an
        empty or already used name."""
        if not name:
            raise LoraError("lora_name", "an adapter name must not be empty")
        if name in self:
            raise LoraError("lora_name", f"adapter {name!r} is already loaded")
        adapter = load_peft_adapter(Path(path), name, self.arch, self.spec, field_name=field_name)
        with self._lock:
            if name in self._entries:  # added meanwhile by another thread
                raise LoraError("lora_name", f"adapter {name!r} is already loaded")
            self._next_version += 1
            self._entries[name] = _Entry(Path(path), self._next_version, field_name)
            self.loads += 1
            self._keep(name, adapter)
        return adapter

    def remove(self, name: str) -> None:
        """Forget ``name`` (its host copy too). Raises :class:`LoraError` (``lora_name``) when
        it is not loaded. An engine slot holding it keeps its weights until reused."""
        with self._lock:
            if self._entries.pop(name, None) is None:
                raise LoraError("lora_name", f"adapter {name!r} is not loaded")
            self._host.pop(name, None)
            self.unloads += 1

    def get(self, name: str) -> LoraAdapter:
        """The loaded adapter ``name`` (most recently used now); re-read from its folder when
        the host LRU dropped it. KeyError for a name not added."""
        return self.get_versioned(name)[0]

    def get_versioned(self, name: str) -> tuple[LoraAdapter, int]:
        """``get(name)`` and ``version(name)``, read together (no add/remove in between)."""
        with self._lock:
            entry = self._entries[name]
            adapter = self._host.get(name)
            if adapter is not None:
                self._host.move_to_end(name)
                return adapter, entry.version
            adapter = load_peft_adapter(entry.path, name, self.arch, self.spec,
                                        field_name=entry.field_name)
            self.loads += 1
            self._keep(name, adapter)
            return adapter, entry.version

    def _keep(self, name: str, adapter: LoraAdapter) -> None:
        self._host[name] = adapter
        self._host.move_to_end(name)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)
            self.host_evictions += 1

    def version(self, name: str) -> int | None:
        """A number that changes whenever ``name`` is added again; None: not added."""
        entry = self._entries.get(name)
        return None if entry is None else entry.version

    def path(self, name: str) -> Path:
        """The folder ``name`` was added from (KeyError: not added)."""
        return self._entries[name].path

    def names(self) -> list[str]:
        """The adapters' names, in the order they were added."""
        return list(self._entries)

    def in_host_memory(self) -> list[str]:
        """The names whose weights are in host memory, least recently used first."""
        with self._lock:
            return list(self._host)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
