"""The ``cache`` slot: prefix caching of the KV cache (block-granular, vLLM-style).

``cache=prefix`` turns prefix caching on; ``cache=none`` (or ``~cache``) is the null
implementation: every prompt is prefilled from scratch. Both size the KV block pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from inferflow.stages.engine_slot import EngineSlot, EngineSpec


@dataclass
class PrefixCache(EngineSlot):
    """Reuse the KV of full ``block_size``-token prompt blocks shared with earlier requests.

    ``num_blocks`` x ``block_size`` tokens is the accounted KV pool (0 = one full slot's worth
    of blocks per slot).
    """

    kind: ClassVar[str] = "cache"
    block_size: int = 16
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0 (0 = automatic), got {self.num_blocks}")

    def contribute(self, spec: EngineSpec) -> None:
        spec.scheduler["enable_prefix_caching"] = True
        spec.shared["block_size"] = self.block_size
        spec.shared["num_blocks"] = self.num_blocks


@dataclass
class NoPrefixCache(PrefixCache):
    """The null cache: same KV accounting, no prefix reuse."""

    def contribute(self, spec: EngineSpec) -> None:
        super().contribute(spec)
        spec.scheduler["enable_prefix_caching"] = False
