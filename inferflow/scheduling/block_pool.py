"""Fixed pool of KV blocks: refcounts, the prefix-cache map and the free list that is also the LRU.

Ints in, ints out: no I/O, no config object, no telemetry. A block is in exactly one of three
states, and ``check_integrity()`` verifies that they partition the pool:

- *free*: ``ref_cnt == 0``, no key; in the free queue;
- *cached*: ``ref_cnt == 0``, has a key; in the free queue (evictable) and in the key map;
- *used*: ``ref_cnt > 0``; not in the free queue (it may also have a key: a shared prefix block).

The free queue is the eviction order: ``allocate`` pops from the front and lazily evicts a popped
block's cached key; ``free`` appends keyed blocks at the back (most recently used) and puts key-less
blocks at the front (they hold nothing worth keeping). Callers free a finished request's blocks
tail-first, so its first blocks (the shared prefix) are evicted last.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field


class BlockPoolError(RuntimeError):
    """The pool was asked for something its invariants forbid (a bug in the caller)."""


@dataclass(eq=False)
class Block:
    """One physical block. ``prev``/``next`` link it into the free queue while it is free."""

    block_id: int
    ref_cnt: int = 0
    key: Hashable | None = None  # prefix-cache key while the block's content is cached
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly-linked queue of free blocks with O(1) ``remove`` (a prefix hit on a cached block).

    Front = least recently used = evicted/allocated first. Sentinels keep the link math branch-free.
    """

    def __init__(self, blocks: Iterable[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next, self._tail.prev = self._tail, self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next

    def popleft(self) -> Block:
        if self._len == 0:
            raise BlockPoolError("no free blocks")
        block = self._head.next
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: Block) -> None:
        self._insert_after(self._tail.prev, block)

    def appendleft(self, block: Block) -> None:
        self._insert_after(self._head, block)

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise BlockPoolError(f"block {block.block_id} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self._len -= 1

    def _insert_after(self, anchor: Block | None, block: Block) -> None:
        if block.prev is not None or block.next is not None:
            raise BlockPoolError(f"block {block.block_id} is already in the free queue")
        assert anchor is not None and anchor.next is not None
        nxt = anchor.next
        anchor.next, block.prev, block.next, nxt.prev = block, anchor, nxt, block
        self._len += 1


class BlockPool:
    """``num_blocks`` blocks with ids ``0..num_blocks-1``; initially all free, in id order."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._cached: dict[Hashable, Block] = {}  # key -> the one block holding that content

    # -- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks ``allocate`` can hand out: truly free plus cached-unreferenced (evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose content is registered in the prefix cache (referenced or not)."""
        return len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def free_block_ids(self) -> list[int]:
        """The free queue front to back (= eviction order); for tests and debugging."""
        return [b.block_id for b in self._free]

    def ref_cnt(self, block_id: int) -> int:
        return self.blocks[block_id].ref_cnt

    def lookup(self, key: Hashable) -> int | None:
        """Id of the block caching ``key``, or None. Does not touch refcounts or LRU order."""
        block = self._cached.get(key)
        return None if block is None else block.block_id

    # -- transitions ---------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue (ref_cnt 0 -> 1), evicting their keys."""
        if n > len(self._free):
            raise BlockPoolError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self._free.popleft()
            if block.key is not None:  # lazy eviction: the cached content dies only now
                del self._cached[block.key]
                block.key = None
            block.ref_cnt = 1
            out.append(block.block_id)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); unreferenced ones leave the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.key is None:
                raise BlockPoolError(f"touch of block {block_id} that caches nothing")
            if block.ref_cnt == 0:
                self._free.remove(block)
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id, in the order given; pass a request's blocks tail-first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise BlockPoolError(f"free of block {block_id} with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.key is None:
                    self._free.appendleft(block)
                else:
                    self._free.append(block)

    def cache(self, block_id: int, key: Hashable) -> bool:
        """Register a used block's (now final) content under ``key``.

        Returns False, changing nothing, when another block already caches ``key`` (two requests
        computed the same prefix concurrently: the first one to finish its block wins).
        """
        block = self.blocks[block_id]
        if block.ref_cnt <= 0 or block.key is not None:
            raise BlockPoolError(f"cache of block {block_id}: must be used and not yet cached")
        if key in self._cached:
            return False
        block.key = key
        self._cached[key] = block
        return True

    # -- invariants ------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise ``AssertionError`` unless free + cached-unreferenced + used == total, etc."""
        in_queue = list(self._free)
        assert len(in_queue) == len(self._free), "free-queue length counter is off"
        queued_ids = {b.block_id for b in in_queue}
        assert len(queued_ids) == len(in_queue), "a block is twice in the free queue"
        free = sum(1 for b in in_queue if b.key is None)
        cached_unref = sum(1 for b in in_queue if b.key is not None)
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert free + cached_unref + used == self.num_blocks, (free, cached_unref, used)
        for b in self.blocks:
            assert b.ref_cnt >= 0, f"block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert (b.ref_cnt == 0) == (b.block_id in queued_ids), f"block {b.block_id} misfiled"
            if b.key is not None:
                assert self._cached.get(b.key) is b, f"block {b.block_id} key not in the map"
        assert all(b.key == k for k, b in self._cached.items()), "map points at a wrong block"
