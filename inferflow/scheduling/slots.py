"""Engine slot allocation: lowest free slot first.

The engine runs each step over the slot range ``[0, max used slot]``, so keeping used slots compact
keeps that range (and its cost) small.
"""

from __future__ import annotations

import heapq


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # min-heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> frozenset[int]:
        return frozenset(self._used)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free slot")
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise RuntimeError(f"slot {slot} is not in use")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.num_slots
        assert set(self._free).isdisjoint(self._used)
