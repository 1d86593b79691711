"""The engine's physical KV layout: computed once, frozen, handed to whoever needs it.

The graph (or the offline ``LLMEngine``) works it out from the config before anything is built;
the executor allocates its buffers from it and the scheduler accounts blocks against it. Nothing
writes it back.

Shapes (per layer): slot KV buffers ``[max_slots, Hkv, max_model_len, D]``; the block pool that
backs the prefix cache and bounds admitted KV ``[num_blocks, Hkv, block_size, D]``.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """``max_slots`` sequences resident at once, ``max_model_len`` positions each, and a pool of
    ``num_blocks`` x ``block_size`` tokens."""

    max_slots: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def __post_init__(self) -> None:
        for name in ("max_slots", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")

    @classmethod
    def plan(
        cls, max_slots: int, max_model_len: int, block_size: int = 16, num_blocks: int = 0
    ) -> KVLayout:
        """The layout for these sizes; ``num_blocks=0`` = one full slot's worth per slot."""
        blocks = num_blocks or max_slots * cdiv(max_model_len, block_size)
        return cls(max_slots, max_model_len, block_size, blocks)
