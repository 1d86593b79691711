"""Per-request KV blocks on top of :class:`BlockPool`: prefix lookup, allocation, saves, free.

Physical picture (DESIGN.md §4): a running sequence's KV lives contiguously in its engine *slot*;
the block pool is the accounted KV memory and the backing store of cached blocks. So:

- a request owns ``ceil(num_computed_tokens / block_size)`` blocks (accounting);
- a prefix hit = ``kv_loads`` (pool block -> the sequence's slot, before the forward pass), after
  which only the rest of the prompt is prefilled;
- a block of a running sequence that becomes full in a step is ``kv_saves``-d (slot -> pool, after
  the forward pass) and registered in the prefix cache by ``commit_saves`` once the step ran.

Sliding window (``window``, paged layouts only: ``KVLayout.freeing_window``): a block table keeps
one entry per block of positions, but the leading blocks that no query at or after the sequence's
next position can see (``num_dead_blocks``) are given back by ``free_outside_window`` and their
entries become ``null_block``. So the table is ``[null] * k + [held blocks]``; a freed block that
caches a full prefix block stays in the prefix cache (evictable), and a prefix hit needs only the
blocks within the window of its end (``find_prefix`` scans from the right, as vLLM's
``SlidingWindowManager``).

The scheduler talks to this class only; it never touches blocks directly.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from inferflow.scheduling.block_hash import BlockKey, ExtraKeys, extend_block_keys
from inferflow.scheduling.block_pool import BlockPool
from inferflow.scheduling.plan import KVBlockCopy


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_prefix_hit_tokens(num_tokens: int) -> int:
    """The named rule "always recompute at least the last prompt token".

    The step that completes a prompt must sample from the logits of its last token, so at least
    that token is computed even when the whole prompt is cached: a hit covers at most
    ``num_tokens - 1`` tokens (rounded down to full blocks by the caller).
    """
    return num_tokens - 1


@dataclass(frozen=True)
class PrefixHit:
    """Result of a lookup: the cached leading blocks and every full-block key computed on the way."""

    block_ids: tuple[int, ...]
    num_tokens: int  # len(block_ids) * block_size
    keys: tuple[BlockKey, ...] = ()


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens looked up (sum of sequence lengths at admission)
    hits: int = 0  # tokens served from the cache


@dataclass
class _Seq:
    blocks: list[int]
    keys: list[BlockKey]
    extra_keys: ExtraKeys
    num_saved: int  # leading blocks that are cached or already scheduled for a save
    pending: dict[int, BlockKey] = field(default_factory=dict)  # block id -> key, saved this step


class KVCacheManager:
    """Owns the pool and every request's block list (keyed by request id); ``window``: free the
    blocks behind this sliding window (``KVLayout.freeing_window``; None: keep every block)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        window: int | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.window = window
        self.null_block = num_blocks  # a freed table entry: KVLayout.null_block, not in the pool
        self.stats = PrefixCacheStats()
        self._seqs: dict[str, _Seq] = {}

    # -- queries ---------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table: block ``i`` holds positions ``[i * block_size, (i + 1) *
        block_size)``; ``null_block`` where the window freed it."""
        seq = self._seqs.get(request_id)
        return [] if seq is None else list(seq.blocks)

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds (its table less the freed entries)."""
        return sum(1 for b in self.block_ids(request_id) if b != self.null_block)

    def num_dead_blocks(self, num_computed_tokens: int) -> int:
        """Leading blocks that no query at position ``num_computed_tokens`` or later sees: a query
        at ``s`` sees ``s - window < j <= s``, so blocks ending at or before ``s - window + 1``."""
        if self.window is None:
            return 0
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def holds(self, request_id: str) -> bool:
        return request_id in self._seqs

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def find_prefix(self, token_ids: Sequence[int], extra_keys: ExtraKeys = ()) -> PrefixHit:
        """Longest chain of cached full blocks of ``token_ids`` (read-only: no refcount change)."""
        if not self.enable_prefix_caching:
            return PrefixHit((), 0)
        limit = max_prefix_hit_tokens(len(token_ids))
        keys = extend_block_keys([], token_ids, limit, self.block_size, extra_keys)
        hits = self._leading_hit(keys) if self.window is None else self._window_hit(keys)
        return PrefixHit(tuple(hits), len(hits) * self.block_size, tuple(keys[: len(hits)]))

    def _leading_hit(self, keys: Sequence[BlockKey]) -> list[int]:
        """Full attention: the leading chain of cached blocks (a key chains its whole prefix, so
        the first miss ends it)."""
        hits: list[int] = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def _window_hit(self, keys: Sequence[BlockKey]) -> list[int]:
        """Sliding window: the longest hit ``e`` blocks long whose blocks ``num_dead_blocks(e *
        block_size) .. e - 1`` are all cached (those are what its first computed query sees), the
        ones before them ``null_block``. Right to left over runs of cached blocks: a run ending
        at ``e`` is a hit iff it reaches back to that first needed block."""
        run_end = 0  # one past the cached run being scanned; 0: none
        for i in range(len(keys) - 1, -1, -1):
            if self.pool.lookup(keys[i]) is None:
                run_end = 0
                continue
            run_end = run_end or i + 1
            first = self.num_dead_blocks(run_end * self.block_size)
            if i <= first:
                hits = [self.null_block] * first
                for key in keys[first:run_end]:
                    block_id = self.pool.lookup(key)
                    assert block_id is not None  # within the run just scanned
                    hits.append(block_id)
                return hits
        return []

    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """Would ``admit(hit, num_tokens)`` succeed? Unreferenced hit blocks leave the free queue too."""
        need = self.num_blocks_for(num_tokens) - len(hit.block_ids)
        evictable_hits = sum(1 for b in self._held(hit.block_ids) if self.pool.ref_cnt(b) == 0)
        return need + evictable_hits <= self.pool.num_free_blocks

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        """Would ``grow(request_id, num_tokens)`` succeed?"""
        need = self.num_blocks_for(num_tokens) - len(self._seqs[request_id].blocks)
        return need <= self.pool.num_free_blocks

    def max_tokens_fitting(self, request_id: str, reserved: int = 0) -> int:
        """Most tokens ``request_id`` can cover (KV positions) with its blocks plus the free ones
        but ``reserved`` (kept for others)."""
        free = max(0, self.pool.num_free_blocks - reserved)
        return (len(self._seqs[request_id].blocks) + free) * self.block_size

    # -- transitions ---------------------------------------------------------------------------
    def admit(
        self,
        request_id: str,
        hit: PrefixHit,
        num_tokens: int,
        slot: int,
        extra_keys: ExtraKeys = (),
    ) -> list[KVBlockCopy]:
        """Take the hit blocks and enough new ones to cover ``num_tokens``; return the kv_loads.

        ``num_tokens`` counts every token with KV after this step (hit + chunk to compute).
        """
        if request_id in self._seqs:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if not self.can_admit(hit, num_tokens):
            raise ValueError(f"request {request_id!r}: not enough free blocks (check can_admit)")
        self.pool.touch(self._held(hit.block_ids))  # before allocate: it cannot evict our hits
        new = self.pool.allocate(self.num_blocks_for(num_tokens) - len(hit.block_ids))
        self._seqs[request_id] = _Seq(
            list(hit.block_ids) + new, list(hit.keys), extra_keys, len(hit.block_ids)
        )
        return [KVBlockCopy(slot, i, b) for i, b in enumerate(hit.block_ids)
                if b != self.null_block]

    def record_lookup(self, num_tokens: int, hit: PrefixHit) -> None:
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += hit.num_tokens

    def grow(self, request_id: str, num_tokens: int) -> None:
        """Allocate blocks so ``request_id`` covers ``num_tokens`` KV positions."""
        seq = self._seqs[request_id]
        if not self.can_grow(request_id, num_tokens):
            raise ValueError(f"request {request_id!r}: not enough free blocks (check can_grow)")
        seq.blocks += self.pool.allocate(self.num_blocks_for(num_tokens) - len(seq.blocks))

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Give back the trailing blocks beyond ``num_tokens`` KV positions (rejected drafts).

        Only blocks past every full block are affected, so nothing cached or being saved is
        freed."""
        seq = self._seqs[request_id]
        keep = self.num_blocks_for(num_tokens)
        if keep < seq.num_saved:
            raise ValueError(f"request {request_id!r}: cannot shrink below its saved blocks")
        if keep < len(seq.blocks):
            self.pool.free(reversed(seq.blocks[keep:]))
            del seq.blocks[keep:]

    def free_outside_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the blocks no query at ``num_computed_tokens`` or later sees (a sequence
        whose next chunk starts there); their entries become ``null_block``. A cached block stays
        cached (evictable); they are freed in position order, so the earliest is evicted first
        (a windowed hit needs the blocks just before its end). Returns how many were freed."""
        seq = self._seqs[request_id]
        freed = []
        for i in range(self.num_dead_blocks(num_computed_tokens) - 1, -1, -1):
            if seq.blocks[i] == self.null_block:
                break  # (the entries before it were nulled by an earlier call)
            freed.append(seq.blocks[i])
            seq.pending.pop(seq.blocks[i], None)
            seq.blocks[i] = self.null_block
        self.pool.free(reversed(freed))
        return len(freed)

    def take_saves(
        self, request_id: str, token_ids: Sequence[int], num_tokens: int, slot: int
    ) -> list[KVBlockCopy]:
        """kv_saves for the blocks that become full once ``token_ids[:num_tokens]`` have KV.

        A block whose content is already cached (or being saved by another request) is skipped,
        and so is one the window freed before it was saved (accepted drafts filled it, and the
        next chunk starts past its window). The keys are registered by ``commit_saves`` after
        the step ran.
        """
        seq = self._seqs[request_id]
        num_full = num_tokens // self.block_size
        if not self.enable_prefix_caching or num_full <= seq.num_saved:
            return []
        extend_block_keys(seq.keys, token_ids, num_tokens, self.block_size, seq.extra_keys)
        pending_keys = {k for s in self._seqs.values() for k in s.pending.values()}
        saves = []
        for i in range(seq.num_saved, num_full):
            key = seq.keys[i]
            freed = seq.blocks[i] == self.null_block
            if not freed and self.pool.lookup(key) is None and key not in pending_keys:
                seq.pending[seq.blocks[i]] = key
                saves.append(KVBlockCopy(slot, i, seq.blocks[i]))
        seq.num_saved = num_full
        return saves

    def commit_saves(self, saves: Iterable[KVBlockCopy]) -> None:
        """After the step ran: register the saved blocks' keys (of requests still holding them)."""
        owners = {b: s for s in self._seqs.values() for b in s.pending}
        for copy in saves:
            seq = owners.get(copy.block_id)
            if seq is not None:
                self.pool.cache(copy.block_id, seq.pending.pop(copy.block_id))

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail-first (its prefix stays cached longest); idempotent."""
        seq = self._seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(self._held(reversed(seq.blocks)))

    def _held(self, block_ids: Iterable[int]) -> list[int]:
        return [b for b in block_ids if b != self.null_block]

    def check_integrity(self) -> None:
        """Pool invariants plus: refcounts equal the number of request block lists holding a
        block; freed (null) entries lead a table, and only under a window."""
        self.pool.check_integrity()
        refs = [0] * self.pool.num_blocks
        for rid, seq in self._seqs.items():
            held = self._held(seq.blocks)
            assert len(set(held)) == len(held), f"{rid} holds a block twice"
            assert seq.blocks[len(seq.blocks) - len(held):] == held, f"{rid}: a null after a block"
            assert self.window is not None or len(held) == len(seq.blocks), rid
            for b in held:
                refs[b] += 1
            assert seq.num_saved <= len(seq.blocks), rid
        for b, n in enumerate(refs):
            assert self.pool.ref_cnt(b) == n, (
                f"block {b}: ref_cnt {self.pool.ref_cnt(b)} != {n} holders"
            )
