"""BlockPool stories: exact block ids and free-list (= eviction) order."""

from __future__ import annotations

import pytest

from inferflow.scheduling.block_pool import BlockPool, BlockPoolError


def test_allocate_takes_from_the_front_and_free_tail_first_keeps_the_prefix_longest() -> None:
    pool = BlockPool(6)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4, 5]
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2]
    assert pool.free_block_ids() == [3, 4, 5]
    pool.cache(0, "k0")
    pool.cache(1, "k1")  # block 2 is a partial block: never cached
    pool.check_integrity()

    pool.free(reversed(blocks))  # a finished request frees tail-first
    # the key-less block goes to the front (worthless), cached ones to the back: 1 then 0,
    # so the first block of the prefix is evicted last
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0 and pool.num_cached_blocks == 2
    pool.check_integrity()


def test_touch_removes_a_cached_block_from_the_middle_of_the_free_list() -> None:
    pool = BlockPool(5)
    a = pool.allocate(2)  # [0, 1]
    pool.cache(0, "k0")
    pool.cache(1, "k1")
    pool.free(reversed(a))
    assert pool.free_block_ids() == [2, 3, 4, 1, 0]

    assert pool.lookup("k1") == 1
    pool.touch([1])  # prefix hit on an unreferenced cached block
    assert pool.free_block_ids() == [2, 3, 4, 0]
    assert pool.ref_cnt(1) == 1
    pool.touch([1])  # a second request shares it
    assert pool.ref_cnt(1) == 2 and pool.free_block_ids() == [2, 3, 4, 0]
    pool.check_integrity()
    pool.free([1])
    assert pool.free_block_ids() == [2, 3, 4, 0]  # still referenced once
    pool.free([1])
    assert pool.free_block_ids() == [2, 3, 4, 0, 1]  # most recently used at the back
    pool.check_integrity()


def test_lazy_eviction_drops_the_key_only_when_the_block_is_reused() -> None:
    pool = BlockPool(3)
    b = pool.allocate(1)[0]
    pool.cache(b, "k")
    pool.free([b])
    assert pool.free_block_ids() == [1, 2, 0]
    assert pool.allocate(2) == [1, 2]
    assert pool.lookup("k") == 0  # still cached while nobody needs the block
    assert pool.allocate(1) == [0]
    assert pool.lookup("k") is None and pool.num_cached_blocks == 0
    pool.check_integrity()


def test_second_block_with_the_same_content_is_not_cached() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache(a, "k") is True
    assert pool.cache(b, "k") is False
    assert pool.lookup("k") == a
    pool.check_integrity()


def test_misuse_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(BlockPoolError):
        pool.allocate(3)
    with pytest.raises(BlockPoolError):
        pool.free([0])  # not allocated
    with pytest.raises(BlockPoolError):
        pool.touch([0])  # caches nothing
    (b,) = pool.allocate(1)
    pool.cache(b, "k")
    with pytest.raises(BlockPoolError):
        pool.cache(b, "k2")  # already cached
    with pytest.raises(ValueError):
        BlockPool(0)
    pool.check_integrity()


def test_check_integrity_catches_a_corrupted_refcount() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool.blocks[0].ref_cnt = 0  # leaked: not in the free queue, not referenced
    with pytest.raises(AssertionError):
        pool.check_integrity()
