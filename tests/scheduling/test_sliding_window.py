"""Sliding-window KV on the paged layout: blocks behind the window go back to the pool, tables
keep their positions (freed entries point at the null block), prefix hits need only the blocks
within the window of their end. The fake executor hashes only what the window sees and fails on
a read of a freed block, so outputs equal to the windowed oracle prove the right blocks were kept."""

from __future__ import annotations

import pytest
from sched_factories import Harness, OracleProposer, expected, make_config, make_request

from inferflow.scheduling import KVLayout
from inferflow.scheduling.block_hash import extend_block_keys
from inferflow.scheduling.kv_budget import describe_layout, paged_context
from inferflow.scheduling.kv_cache_manager import KVCacheManager
from inferflow.scheduling.layout import kv_window, window_blocks

BS = 4
NULL = 8  # the null block of an 8-block pool: KVLayout.null_block


def admit_all(kv: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Admit ``rid`` computing all of ``tokens`` in one step and register its full blocks."""
    hit = kv.find_prefix(tokens)
    kv.admit(rid, hit, len(tokens), slot=0)
    kv.commit_saves(kv.take_saves(rid, tokens, len(tokens), slot=0))
    kv.check_integrity()


def test_blocks_behind_the_window_are_freed_and_stay_cached() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, window=6)
    a = list(range(1, 11))  # 10 tokens: blocks 0, 1 full, block 2 partial
    admit_all(kv, "a", a)
    assert kv.block_ids("a") == [0, 1, 2] and kv.pool.num_free_blocks == 5

    # a query at 10 sees 5..10: block 0 (positions 0..3) is dead, block 1 (4..7) is not
    assert [kv.num_dead_blocks(s) for s in (4, 5, 8, 9, 12, 13)] == [0, 0, 0, 1, 1, 2]
    assert kv.free_outside_window("a", 10) == 1
    assert kv.block_ids("a") == [NULL, 1, 2] and kv.num_held_blocks("a") == 2
    assert kv.pool.num_free_blocks == 6 and kv.pool.num_cached_blocks == 2  # 0 is evictable
    assert kv.pool.free_block_ids() == [3, 4, 5, 6, 7, 0]
    assert kv.free_outside_window("a", 10) == 0  # idempotent
    kv.check_integrity()

    # decode to 13 tokens: block 2 fills (and is registered), block 1 falls out of the window
    a += [11, 12, 13]
    kv.grow("a", 13)
    kv.commit_saves(kv.take_saves("a", a, 13, slot=0))
    assert kv.block_ids("a") == [NULL, 1, 2, 3]
    assert kv.free_outside_window("a", 13) == 1
    assert kv.block_ids("a") == [NULL, NULL, 2, 3] and kv.pool.num_free_blocks == 6
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 0, 1]
    kv.check_integrity()

    # rejected drafts roll back behind the held blocks only; free gives back the held ones
    kv.grow("a", 17)
    assert kv.block_ids("a") == [NULL, NULL, 2, 3, 4]
    kv.shrink("a", 14)
    assert kv.block_ids("a") == [NULL, NULL, 2, 3]
    kv.free("a")
    assert kv.pool.num_free_blocks == 8 and kv.pool.num_cached_blocks == 3
    kv.check_integrity()


def test_a_windowed_prefix_hit_needs_only_the_blocks_within_the_window_of_its_end() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, window=6)
    a = list(range(1, 14))  # 13 tokens: blocks 0, 1, 2 full (cached), block 3 partial
    admit_all(kv, "a", a)
    assert kv.free_outside_window("a", 13) == 2  # a query at 13 sees 8..13
    assert kv.block_ids("a") == [NULL, NULL, 2, 3]
    assert kv.pool.free_block_ids() == [4, 5, 6, 7, 0, 1]  # position order: 0 evicted first

    # a hit 12 tokens long: its first query (at 12) sees 7..12, so blocks 1 and 2 are needed
    prompt = [*a[:12], 99, 98]
    hit = kv.find_prefix(prompt)
    assert hit.block_ids == (NULL, 1, 2) and hit.num_tokens == 12 and len(hit.keys) == 3

    # block 0 evicted: full attention would have no hit at all, the windowed one stands
    kv.pool.free(kv.pool.allocate(5))  # 4..7, then block 0 loses its content
    assert kv.pool.lookup(hit.keys[0]) is None
    assert kv.find_prefix(prompt) == hit

    # admission takes a reference on the needed blocks only and loads nothing through null
    loads = kv.admit("b", hit, len(prompt), slot=1)
    assert [(c.block_index, c.block_id) for c in loads] == [(1, 1), (2, 2)]
    assert kv.block_ids("b") == [NULL, 1, 2, 0]  # + one new block: 0, first in the queue
    assert (kv.pool.ref_cnt(1), kv.pool.ref_cnt(2)) == (1, 2)
    kv.check_integrity()


def test_a_hit_with_a_needed_block_missing_is_cut_to_the_longest_valid_one() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, window=6)
    a = list(range(1, 14))
    admit_all(kv, "a", a)
    kv.free_outside_window("a", 13)  # blocks 0, 1 cached and evictable, 2 still held
    kv.pool.touch([0])
    kv.pool.free([0])  # block 0 used again: most recent, so block 1 is evicted before it
    kv.pool.free(kv.pool.allocate(5))  # 4..7, then block 1 loses its content
    keys = extend_block_keys([], a, 12, BS)
    assert [kv.pool.lookup(k) for k in keys] == [0, None, 2]
    # ends 3 (needs 1, 2) and 2 (needs 0, 1) lack block 1: the hit is block 0 alone
    hit = kv.find_prefix([*a[:12], 99, 98])
    assert hit.block_ids == (0,) and hit.num_tokens == 4


def test_decoding_past_the_window_frees_blocks_and_outputs_match_the_windowed_oracle() -> None:
    cfg = make_config(paged=True, block_size=4, num_blocks=16, sliding_window=8)
    h = Harness(cfg)
    r = make_request("a", list(range(1, 11)), max_tokens=30, ignore_eos=True)
    h.add(r)
    kv, null = h.scheduler.kv, cfg.num_blocks
    while h.scheduler.has_unfinished_requests():
        h.step()
        (chunk,) = h.last_plan.chunks
        table = chunk.block_table
        # the table keeps one entry per block of positions; exactly the dead ones are null
        assert len(table) == -(-(chunk.start_pos + len(chunk.token_ids)) // 4)
        dead = kv.num_dead_blocks(chunk.start_pos)
        assert table[:dead] == (null,) * dead and null not in table[dead:]
        assert len(table) - dead <= window_blocks(8, 4, len(chunk.token_ids))
        if not r.is_finished:  # the pool's free count follows the held blocks
            assert h.scheduler.stats.num_kv_blocks_used == kv.num_held_blocks("a") == len(
                table) - dead
    assert r.output_token_ids == expected(r, cfg) and len(r.output_token_ids) == 30
    assert h.scheduler.stats.num_kv_blocks_used == 0
    assert dead == (38 - 8 + 1) // 4 == 7  # the last decode, at 38: 7 blocks freed


def test_a_context_longer_than_the_pool_runs_under_a_window() -> None:
    # 4 blocks of 4 = 16 tokens of KV for 10 + 30 tokens: refused without the window
    kw = dict(paged=True, block_size=4, num_blocks=4, max_model_len=64, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="KV blocks"):
        Harness(make_config(**kw)).add(make_request("a", [1] * 10, max_tokens=30))
    cfg = make_config(**kw, sliding_window=5)  # a chunk of 8 + 4 behind it: 4 blocks
    assert window_blocks(5, 4, 8) == 4
    h = Harness(cfg)
    reqs = [make_request(f"r{i}", [i + 1] * 10 + list(range(20, 20 + 5 * i)), max_tokens=30,
                         ignore_eos=True, arrival_time=i) for i in range(3)]
    h.add(*reqs)
    h.run()
    assert h.outputs() == {r.request_id: expected(r, cfg) for r in reqs}
    assert min(r.num_tokens for r in reqs) - 1 > cfg.num_blocks * cfg.block_size  # KV tokens
    # without chunked prefill a recompute prefills everything at once: no bound, refused
    unchunked = make_config(**{**kw, "max_num_batched_tokens": 64}, sliding_window=5,
                            enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="KV blocks"):
        Harness(unchunked).add(make_request("a", [1] * 10, max_tokens=30))


def test_a_second_request_hits_the_blocks_within_the_window_and_matches() -> None:
    cfg = make_config(paged=True, block_size=4, num_blocks=16, sliding_window=6)
    h = Harness(cfg)
    shared = list(range(1, 21))  # 20 tokens: 5 full blocks
    a = make_request("a", [*shared, 30], max_tokens=4, ignore_eos=True)
    h.add(a)
    h.run()
    b = make_request("b", [*shared, 40], max_tokens=4, ignore_eos=True)
    h.add(b)
    h.step()
    (chunk,) = h.last_plan.chunks
    # 20 tokens hit; the first query (at 20) sees 15..20: blocks 3, 4 are needed, 0..2 are not
    assert chunk.start_pos == 20 and b.metrics.num_cached_prompt_tokens == 20
    assert chunk.block_table[:3] == (cfg.num_blocks,) * 3
    h.run()
    assert b.output_token_ids == expected(b, cfg)


@pytest.mark.parametrize("error_rate", [0.0, 0.5])
def test_speculative_decoding_under_a_window_rolls_back_and_matches(error_rate: float) -> None:
    """Accepted drafts fill blocks that the next step's window frees before they were saved
    (the save skips them); rejected ones roll back past the held blocks."""
    cfg = make_config(paged=True, block_size=2, num_blocks=8, sliding_window=2,
                      max_num_batched_tokens=8)  # window_blocks(2, 2, 8) = 6 <= 8
    h = Harness(cfg, OracleProposer(4, error_rate, window=2))
    reqs = [make_request(f"r{i}", [i + 1, 2, 3], max_tokens=24, ignore_eos=True)
            for i in range(2)]
    h.add(*reqs)
    h.run()
    assert h.outputs() == {r.request_id: expected(r, cfg) for r in reqs}
    spec = h.scheduler.spec_stats
    assert spec.num_accepted_tokens > 0
    assert (spec.num_accepted_tokens < spec.num_draft_tokens) == (error_rate > 0)


def test_preempted_windowed_requests_recompute_to_the_same_output() -> None:
    kw = dict(paged=True, block_size=2, num_blocks=8, max_num_batched_tokens=6, max_slots=4)
    prompts = [[i + 1] * 3 + [i + 10, i + 20] for i in range(4)]
    outputs = {}
    for window in (3, 64):  # 64: never freed, so tight memory preempts
        cfg = make_config(**kw, sliding_window=window, max_model_len=64)
        h = Harness(cfg)
        reqs = [make_request(f"r{i}", p, max_tokens=10, ignore_eos=True, arrival_time=i)
                for i, p in enumerate(prompts)]
        h.add(*reqs)
        h.run()
        assert h.outputs() == {r.request_id: expected(r, cfg) for r in reqs}
        outputs[window] = h.scheduler.stats.num_preemptions
    assert outputs[64] > outputs[3]  # the window frees blocks: fewer preemptions


def test_the_layout_carries_the_window_and_only_the_paged_one_frees() -> None:
    assert kv_window((4096,) * 4) == 4096
    assert kv_window((512, None, 512)) is None and kv_window(()) is None
    paged = KVLayout.plan(4, 128, 16, 32, paged=True, sliding_window=64)
    slots = KVLayout.plan(4, 128, 16, 32, paged=False, sliding_window=64)
    assert (paged.freeing_window, slots.freeing_window) == (64, None)
    assert paged.null_block == 32
    assert "64-token window" in describe_layout(paged, None)
    with pytest.raises(ValueError, match="sliding_window"):
        KVLayout(4, 128, 16, 32, True, 0)
    # the pool caps a paged context unless it holds what a windowed sequence holds at once
    assert paged_context(4096, 4, 16, 32, None).served == 512
    assert paged_context(4096, 4, 16, 32, None, window_need=10).served == 4096
    assert paged_context(4096, 4, 16, 32, None, window_need=40).served == 512
