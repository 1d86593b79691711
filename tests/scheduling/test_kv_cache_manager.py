"""KVCacheManager story: miss -> hit -> free -> evict, with exact block ids and loads/saves."""

from __future__ import annotations

from inferflow.scheduling.block_hash import hash_block
from inferflow.scheduling.kv_cache_manager import KVCacheManager, max_prefix_hit_tokens
from inferflow.scheduling.plan import KVBlockCopy

BS = 4


def admit_all(kv: KVCacheManager, rid: str, tokens: list[int], slot: int) -> list[KVBlockCopy]:
    """Admit ``rid`` computing its whole prompt; commit the step's saves. Returns the loads."""
    hit = kv.find_prefix(tokens)
    loads = kv.admit(rid, hit, len(tokens), slot)
    kv.record_lookup(len(tokens), hit)
    kv.commit_saves(kv.take_saves(rid, tokens, len(tokens), slot))
    kv.check_integrity()
    return loads


def test_miss_hit_free_evict() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = list(range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens

    # miss: three fresh blocks; the two full ones are saved from slot 0 and cached
    hit = kv.find_prefix(a)
    assert hit.block_ids == () and hit.num_tokens == 0
    assert kv.admit("a", hit, len(a), slot=0) == []
    assert kv.block_ids("a") == [0, 1, 2]
    saves = kv.take_saves("a", a, len(a), slot=0)
    assert saves == [KVBlockCopy(0, 0, 0), KVBlockCopy(0, 1, 1)]
    kv.commit_saves(saves)
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7]
    kv.check_integrity()

    # hit: same 8-token prefix, different tail -> loads blocks 0 and 1 into slot 1
    b = [*a[:8], 99, 98, 97]
    loads = admit_all(kv, "b", b, slot=1)
    assert loads == [KVBlockCopy(1, 0, 0), KVBlockCopy(1, 1, 1)]
    assert kv.block_ids("b") == [0, 1, 3]
    assert (kv.pool.ref_cnt(0), kv.pool.ref_cnt(1)) == (2, 2)
    assert kv.stats.hits == 8 and kv.stats.queries == 11  # "a" was admitted by hand

    # free: tail-first; key-less blocks to the front, the shared prefix to the very back
    kv.free("a")
    assert kv.pool.free_block_ids() == [2, 4, 5, 6, 7]
    kv.free("b")
    assert kv.pool.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]
    kv.check_integrity()

    # a hit on unreferenced cached blocks takes them out of the free list (O(1) removal)
    admit_all(kv, "c", a, slot=0)
    assert kv.block_ids("c") == [0, 1, 3]
    assert kv.pool.free_block_ids() == [2, 4, 5, 6, 7]
    kv.free("c")
    assert kv.pool.free_block_ids() == [3, 2, 4, 5, 6, 7, 1, 0]

    # evict: 7 blocks for a new prompt reuse the LRU blocks; cached block 1 is evicted, 0 survives
    d = list(range(100, 128))
    admit_all(kv, "d", d, slot=0)
    assert kv.block_ids("d") == [3, 2, 4, 5, 6, 7, 1]
    assert kv.find_prefix(a).block_ids == (0,)
    kv.free("d")
    kv.check_integrity()


def test_always_recompute_the_last_prompt_token() -> None:
    assert max_prefix_hit_tokens(8) == 7
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = list(range(8))  # exactly two full blocks, both cached below
    admit_all(kv, "a", p, slot=0)
    kv.free("a")
    hit = kv.find_prefix(p)
    assert hit.block_ids == (0,)
    assert hit.num_tokens == 4  # not 8: the last token is recomputed, so its block is too
    assert kv.find_prefix([*p, 8]).num_tokens == 8


def test_extra_keys_separate_caches() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = list(range(9))
    hit = kv.find_prefix(p, ("lora-1",))
    kv.admit("a", hit, len(p), 0, ("lora-1",))
    kv.commit_saves(kv.take_saves("a", p, len(p), 0))
    assert kv.find_prefix(p, ("lora-1",)).num_tokens == 8
    assert kv.find_prefix(p, ("lora-2",)).num_tokens == 0
    assert kv.find_prefix(p).num_tokens == 0


def test_keys_chain_the_prefix_and_keep_token_ids() -> None:
    k0 = hash_block(None, [1, 2, 3, 4])
    k0b = hash_block(None, [9, 2, 3, 4])
    assert hash_block(k0, [5, 6, 7, 8]) != hash_block(k0b, [5, 6, 7, 8])  # same block, other parent
    assert hash_block(k0, [5, 6, 7, 8]).token_ids == (5, 6, 7, 8)
    assert hash_block(None, [1, 2, 3, 4]) == k0


def test_concurrent_identical_blocks_are_saved_once() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    p = list(range(6))
    for rid, slot in (("a", 0), ("b", 1)):  # both miss: neither block is cached yet
        kv.admit(rid, kv.find_prefix(p), len(p), slot)
    saves_a = kv.take_saves("a", p, len(p), 0)
    saves_b = kv.take_saves("b", p, len(p), 1)
    assert saves_a == [KVBlockCopy(0, 0, 0)] and saves_b == []
    kv.commit_saves(saves_a + saves_b)
    assert kv.pool.num_cached_blocks == 1
    kv.check_integrity()


def test_saves_of_a_freed_request_are_dropped() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    p = list(range(5))
    kv.admit("a", kv.find_prefix(p), len(p), 0)
    saves = kv.take_saves("a", p, len(p), 0)
    kv.free("a")  # cancelled between schedule and update
    kv.commit_saves(saves)
    assert kv.pool.num_cached_blocks == 0
    kv.check_integrity()


def test_grow_and_fit() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.admit("a", kv.find_prefix([1, 2, 3]), 3, 0)
    assert kv.max_tokens_fitting("a") == 16
    assert kv.can_grow("a", 16) and not kv.can_grow("a", 17)
    kv.grow("a", 9)
    assert kv.block_ids("a") == [0, 1, 2]
    kv.check_integrity()
