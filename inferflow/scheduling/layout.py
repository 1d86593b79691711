"""The engine's physical KV layout: computed once, frozen, handed to whoever needs it.

The graph (or the offline ``LLMEngine``) works it out from the config before anything is built;
the executor allocates its buffers from it and the scheduler accounts blocks against it. Nothing
writes it back.

Two layouts:

- *slots* (ONNX Runtime, TensorRT): per layer, slot KV buffers ``[max_slots, Hkv, max_model_len,
  D]`` that the forward pass reads, plus the block pool behind the prefix cache and admission
  ``[num_blocks, Hkv, block_size, D]`` (prefix hits are copied pool -> slot, full blocks slot ->
  pool);
- *paged* (``paged=True``, the torch executor): the block pool is the only KV memory, per layer
  ``[num_blocks, block_size, Hkv, D]``; a sequence's KV lives in the blocks of its block table
  (the scheduler's block ids *are* the physical blocks), a prefix hit shares blocks by refcount
  and nothing is copied. ``max_slots`` is then only the number of batch rows (running sequences)
  and reserves no memory.
"""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVLayout:
    """``max_slots`` sequences resident at once, ``max_model_len`` positions each, and a pool of
    ``num_blocks`` x ``block_size`` tokens (``paged``: the pool is where the KV lives)."""

    max_slots: int
    max_model_len: int
    block_size: int
    num_blocks: int
    paged: bool = False

    def __post_init__(self) -> None:
        for name in ("max_slots", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")

    @classmethod
    def plan(
        cls,
        max_slots: int,
        max_model_len: int,
        block_size: int = 16,
        num_blocks: int = 0,
        paged: bool = False,
    ) -> KVLayout:
        """The layout for these sizes; ``num_blocks=0`` = one full slot's worth per slot."""
        blocks = num_blocks or max_slots * cdiv(max_model_len, block_size)
        return cls(max_slots, max_model_len, block_size, blocks, paged)

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table (paged): blocks of one ``max_model_len`` sequence."""
        return cdiv(self.max_model_len, self.block_size)
