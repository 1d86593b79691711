"""The ``cache`` slot: the prefix cache over the KV block pool (block-granular, vLLM-style).

``cache=prefix`` (:class:`PrefixCache`) reuses the KV of full prompt blocks shared with earlier
requests; ``cache=none`` or ``~cache`` (:class:`NoPrefixCache`, the null implementation)
prefills every prompt from scratch. Both size the KV block pool (``block_size``, ``num_blocks``).
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from inferflow.config.tunable import tunable
from inferflow.stages.engine_slot import EngineStage

if TYPE_CHECKING:
    from inferflow.scheduling.kv_cache_manager import KVCacheManager
    from inferflow.scheduling.layout import KVLayout


@dataclass
class CacheStage(EngineStage):
    """Contract of the ``cache`` slot.

    - ``block_size`` (tokens per KV block) and ``num_blocks`` (the accounted KV pool; 0 = one full
      slot's worth of blocks per slot) go into the engine's frozen ``KVLayout``;
    - :meth:`create` builds the scheduler's block accounting and prefix cache for that layout
      (called once, in the engine worker); ``enabled`` says whether prefixes are reused.
    """

    kind: ClassVar[str] = "cache"
    block_size: int = tunable(16, choices=(8, 16, 32, 64), simulated=False,
                              note="tokens per KV block: prefix-hit granularity, attention reads")
    num_blocks: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {self.block_size}")
        if self.num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0 (0 = automatic), got {self.num_blocks}")

    @property
    @abstractmethod
    def enabled(self) -> bool:
        """True when requests may reuse cached prefix blocks."""

    def create(self, layout: KVLayout) -> KVCacheManager:
        from inferflow.scheduling.kv_cache_manager import KVCacheManager

        return KVCacheManager(
            layout.num_blocks, layout.block_size, self.enabled, layout.freeing_window)


@dataclass
class PrefixCache(CacheStage):
    """Reuse the KV of full ``block_size``-token prompt blocks shared with earlier requests
    (block-hash chain, LRU eviction of unreferenced blocks)."""

    @property
    def enabled(self) -> bool:
        return True


@dataclass
class NoPrefixCache(CacheStage):
    """The null cache: same KV accounting, no prefix reuse (what ``~cache`` gives too)."""

    @property
    def enabled(self) -> bool:
        return False
