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
  and reserves no memory. The executor holds one more physical block, id ``num_blocks``
  (``null_block``): scratch that padding rows write into, and what a block-table entry whose
  block was freed points at (see below); it is never read unmasked.

Sliding windows (``sliding_window``: the model's window when *every* layer has one; a query at
position ``p`` sees keys ``p - W < j <= p``). Once a sequence's next query is at position ``s``,
the KV of positions ``j <= s - W`` is never read again:

- paged: the scheduler frees those blocks (a full block whose content is cached stays in the
  prefix cache, evictable) and their block-table entries become ``null_block``, so the table keeps
  its positional meaning and a running sequence holds at most ``window_blocks`` blocks. With
  chunked prefill the served context is then not capped by the pool (``paged_context``);
- slots: nothing is freed. A slot holds the whole context (``max_model_len`` positions) whatever
  the window, the forward pass masks what is outside it, and the pool behind the prefix cache
  keeps whole prefixes. The slot layout gains no memory from a window.

A model with one global layer (Gemma 2/3, Qwen2 with ``max_window_layers``) has no
``sliding_window`` here: every layer's KV is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_window(layer_windows: Sequence[int | None]) -> int | None:
    """The window behind which no layer reads KV: the largest one when every layer has a window
    (``ModelArch.layer_windows``); None when some layer attends to the whole context or none
    has a window."""
    if not layer_windows or any(w is None for w in layer_windows):
        return None
    return max(w for w in layer_windows if w is not None)


def window_blocks(window: int, block_size: int, max_chunk: int) -> int:
    """Most blocks a sequence holds at once under a ``window`` when it computes at most
    ``max_chunk`` tokens a step: a chunk starting at ``s`` needs positions ``[s - window + 1,
    s + max_chunk)``, which straddle at most this many blocks."""
    return cdiv(window - 1 + max_chunk, block_size) + 1


@dataclass(frozen=True)
class KVLayout:
    """``max_slots`` sequences resident at once, ``max_model_len`` positions each, and a pool of
    ``num_blocks`` x ``block_size`` tokens (``paged``: the pool is where the KV lives);
    ``sliding_window``: the model's window when every layer has one (``kv_window``), else None."""

    max_slots: int
    max_model_len: int
    block_size: int
    num_blocks: int
    paged: bool = False
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_slots", "block_size", "num_blocks"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {self.sliding_window}")

    @classmethod
    def plan(
        cls,
        max_slots: int,
        max_model_len: int,
        block_size: int = 16,
        num_blocks: int = 0,
        paged: bool = False,
        sliding_window: int | None = None,
    ) -> KVLayout:
        """The layout for these sizes; ``num_blocks=0`` = one full slot's worth per slot."""
        blocks = num_blocks or max_slots * cdiv(max_model_len, block_size)
        return cls(max_slots, max_model_len, block_size, blocks, paged, sliding_window)

    @property
    def max_blocks_per_seq(self) -> int:
        """Width of a block table (paged): blocks of one ``max_model_len`` sequence."""
        return cdiv(self.max_model_len, self.block_size)

    @property
    def null_block(self) -> int:
        """Paged: the physical block id past the pool (the executor's scratch block)."""
        return self.num_blocks

    @property
    def freeing_window(self) -> int | None:
        """The window behind which the scheduler frees a sequence's blocks: ``sliding_window`` on
        a paged layout; None on slots (they keep the whole context, see the module doc)."""
        return self.sliding_window if self.paged else None
