"""Scheduler stories against the KV-simulating fake executor; integrity checked after every step."""

from __future__ import annotations

import pytest
from sched_factories import (
    Harness,
    clone,
    expected,
    make_config,
    make_request,
    make_scheduler,
    run_alone_outputs,
)

from inferflow.scheduling import RequestStatus, SchedulerConfigError
from inferflow.scheduling.integrity import check_scheduler
from inferflow.scheduling.plan import KVBlockCopy


def test_one_request_prefills_then_decodes_to_the_reference_output() -> None:
    cfg = make_config()
    h = Harness(cfg)
    r = make_request("a", [5, 6, 7, 8, 9], max_tokens=4, ignore_eos=True)
    h.add(r)
    h.step()
    (chunk,) = h.last_plan.chunks
    assert (chunk.slot, chunk.start_pos, chunk.token_ids, chunk.sample) == (
        0,
        0,
        (5, 6, 7, 8, 9),
        True,
    )
    assert h.last_plan.kv_saves == (KVBlockCopy(0, 0, 0),)  # block 0 became full
    assert h.scheduler.kv.block_ids("a") == [0, 1]
    h.step()
    (chunk,) = h.last_plan.chunks
    assert (chunk.start_pos, chunk.token_ids, chunk.num_output_tokens) == (
        5,
        (r.output_token_ids[0],),
        1,
    )
    h.run()
    assert r.output_token_ids == expected(r, cfg) and r.finish_reason == "length"
    assert h.scheduler.stats.num_kv_blocks_used == 0
    assert h.updates[-1][0].finished and h.updates[-1][0].new_token_ids == (r.output_token_ids[-1],)


def test_shared_system_prompt_prefills_only_the_suffix() -> None:
    cfg = make_config()
    system = list(range(1, 13))  # 12 tokens = 3 full blocks of 4
    h = Harness(cfg)
    a = make_request("a", [*system, 20, 21], max_tokens=3, ignore_eos=True)
    h.add(a)
    h.run()
    # a's 16 KV tokens filled blocks 0..3, all saved, freed tail-first: the prefix is evicted last
    assert h.scheduler.kv.pool.free_block_ids()[-4:] == [3, 2, 1, 0]

    b = make_request("b", [*system, 30, 31, 32], max_tokens=5)
    h.add(b)
    h.step()
    plan = h.last_plan
    assert plan.kv_loads == (KVBlockCopy(0, 0, 0), KVBlockCopy(0, 1, 1), KVBlockCopy(0, 2, 2))
    (chunk,) = plan.chunks
    assert (chunk.start_pos, chunk.token_ids) == (12, (30, 31, 32))  # only the unshared suffix
    assert b.metrics.num_cached_prompt_tokens == 12
    assert h.scheduler.stats.prefix_cache_hits == 12
    assert h.scheduler.stats.prefix_cache_queries == 14 + 15
    h.run()

    no_cache = Harness(make_config(enable_prefix_caching=False))
    b2 = clone(b)
    no_cache.add(clone(a), b2)
    no_cache.run()
    assert b.output_token_ids == b2.output_token_ids == expected(b, cfg)
    assert no_cache.scheduler.stats.prefix_cache_hits == 0


def test_concurrent_requests_share_cached_prefix_blocks() -> None:
    cfg = make_config()
    system = list(range(1, 9))
    h = Harness(cfg)
    a = make_request("a", [*system, 40], max_tokens=6, ignore_eos=True)
    h.add(a)
    h.step()  # a's prompt ran; blocks 0 and 1 were saved and are now cached
    b = make_request("b", [*system, 50, 51], max_tokens=6, ignore_eos=True)
    h.add(b)
    h.step()
    assert h.last_plan.kv_loads == (KVBlockCopy(1, 0, 0), KVBlockCopy(1, 1, 1))
    assert [h.scheduler.kv.pool.ref_cnt(i) for i in (0, 1)] == [2, 2]
    h.run()
    assert a.output_token_ids == expected(a, cfg) and b.output_token_ids == expected(b, cfg)


def test_long_prompt_prefills_in_chunks_while_decodes_get_a_token_every_step() -> None:
    cfg = make_config(
        max_model_len=2100, block_size=128, num_blocks=20, max_num_batched_tokens=256, max_slots=4
    )
    h = Harness(cfg)
    d1 = make_request("d1", [1, 2, 3], max_tokens=40, ignore_eos=True)
    d2 = make_request("d2", [4, 5, 6, 7], max_tokens=40, ignore_eos=True)
    h.add(d1, d2)
    h.step()
    long = make_request(
        "long", [(i * 7) % 61 + 1 for i in range(2000)], max_tokens=3, ignore_eos=True
    )
    h.add(long)
    prefill_steps = 0
    while long.num_output_tokens == 0:
        before = (d1.num_output_tokens, d2.num_output_tokens)
        h.step()
        rows = h.executor.history[-1].rows
        assert rows["d1"][1:] == (1, True) and rows["d2"][1:] == (1, True)
        assert (d1.num_output_tokens, d2.num_output_tokens) == (before[0] + 1, before[1] + 1)
        assert rows["long"][1] <= 256 - 2
        prefill_steps += 1
    assert prefill_steps == 8  # ceil(2000 / 254): chunks of 254 = budget minus two decodes
    h.run()
    for r in (d1, d2, long):
        assert r.output_token_ids == expected(r, cfg)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_memory_pressure_preempts_and_outputs_are_unchanged(prefix_caching: bool) -> None:
    prompts = [[i + 1] * 3 + [i + 10, i + 20, i + 30] for i in range(4)]
    outputs = {}
    for num_blocks in (8, 64):
        cfg = make_config(num_blocks=num_blocks, enable_prefix_caching=prefix_caching)
        h = Harness(cfg)
        reqs = [
            make_request(f"r{i}", p, max_tokens=12, ignore_eos=True, arrival_time=i)
            for i, p in enumerate(prompts)
        ]
        h.add(*reqs)
        h.run()
        preemptions = h.scheduler.stats.num_preemptions
        assert (preemptions > 0) == (num_blocks == 8)
        assert sum(r.metrics.num_preemptions for r in reqs) == preemptions
        outputs[num_blocks] = h.outputs()
        assert outputs[num_blocks] == {r.request_id: expected(r, cfg) for r in reqs}
    assert outputs[8] == outputs[64]


def test_preemption_victim_is_the_latest_arrival_and_it_resumes_with_its_output() -> None:
    cfg = make_config(num_blocks=4, max_slots=2, enable_prefix_caching=False)
    h = Harness(cfg)
    a = make_request("a", [1, 2, 3, 4], max_tokens=8, ignore_eos=True, arrival_time=0)
    b = make_request("b", [5, 6, 7, 8], max_tokens=8, ignore_eos=True, arrival_time=1)
    h.add(a, b)
    for _ in range(5):  # prompts (1 block each), then decodes fill 2 blocks each: 8 KV tokens
        h.step()
        assert set(h.last_plan.chunks[i].request_id for i in range(2)) == {"a", "b"}
    assert h.scheduler.stats.num_kv_blocks_free == 0
    h.step()  # a needs a 3rd block: b (latest arrival) is preempted, a decodes alone
    assert [c.request_id for c in h.last_plan.chunks] == ["a"]
    assert h.last_plan.finished_request_ids == frozenset({"b"})
    assert b.status == RequestStatus.PREEMPTED and b.num_output_tokens == 5
    assert list(h.scheduler.waiting) == [b]
    h.run()
    resumed = next(p for p in h.executor.plans[6:] if any(c.request_id == "b" for c in p.chunks))
    (chunk,) = [c for c in resumed.chunks if c.request_id == "b"]
    assert (
        chunk.start_pos == 0 and len(chunk.token_ids) == 4 + 5 and chunk.sample
    )  # prompt + output
    assert b.metrics.num_preemptions == 1
    assert a.output_token_ids == expected(a, cfg) and b.output_token_ids == expected(b, cfg)


def test_cancellation_frees_slot_and_blocks_at_once_and_is_reported_in_the_next_plan() -> None:
    cfg = make_config()
    h = Harness(cfg)
    a, b, c = (make_request(x, [1, 2, 3, 4, 5], max_tokens=8, ignore_eos=True) for x in "abc")
    h.add(a, b)
    h.step()
    h.add(c)
    used = h.scheduler.stats.num_kv_blocks_used
    assert h.scheduler.finish_requests(["a", "c", "nope"]) == [a, c]
    assert (a.status, c.status, a.finish_reason) == (RequestStatus.FINISHED_ABORTED,) * 2 + (
        "abort",
    )
    assert h.scheduler.stats.num_kv_blocks_used == used - 2 and h.scheduler.slots.used == {1}
    check_scheduler(h.scheduler)
    h.step()
    assert h.last_plan.finished_request_ids == frozenset({"a", "c"})
    assert [ch.request_id for ch in h.last_plan.chunks] == ["b"]
    h.scheduler.finish_requests(["b"], RequestStatus.FINISHED_STOPPED)  # a stop string matched
    assert b.finish_reason == "stop" and not h.scheduler.has_unfinished_requests()
    assert h.scheduler.stats.num_kv_blocks_used == 0
    with pytest.raises(ValueError):
        h.scheduler.finish_requests(["x"], RequestStatus.RUNNING)


def test_slots_lowest_free_first() -> None:
    h = Harness(make_config())
    reqs = [make_request(f"r{i}", [i + 1, 2, 3], max_tokens=10, ignore_eos=True) for i in range(3)]
    h.add(*reqs)
    h.step()
    assert [r.slot for r in reqs] == [0, 1, 2]
    h.scheduler.finish_requests(["r1"])
    d = make_request("d", [9, 9], max_tokens=2, ignore_eos=True)
    h.add(d)
    h.step()
    assert d.slot == 1


def run_mode(mode: str, reqs: list, **overrides: object) -> Harness:
    h = Harness(make_config(mode=mode, max_num_seqs=2, **overrides))
    h.add(*[clone(r) for r in reqs])
    h.run()
    return h


def test_static_and_none_modes_give_the_same_outputs_with_their_batch_shapes() -> None:
    reqs = [
        make_request(f"r{i}", [i + 1, i + 2, 3, 4], max_tokens=2 + 3 * i, ignore_eos=True)
        for i in range(5)
    ]
    cfg = make_config()
    want = {r.request_id: expected(r, cfg) for r in reqs}
    runs = {m: run_mode(m, reqs) for m in ("continuous", "static", "none")}
    for h in runs.values():
        assert h.outputs() == want

    def joins(h: Harness) -> list[tuple[set[str], set[str]]]:
        """(new ids, other ids) of every step in which a request ran for the first time."""
        seen: set[str] = set()
        out = []
        for rec in h.executor.history:
            new = set(rec.rows) - seen
            seen |= new
            if new:
                out.append((new, set(rec.rows) - new))
        return out

    assert all(others == set() for _, others in joins(runs["static"]))  # a batch starts empty
    assert [sorted(new) for new, _ in joins(runs["static"])] == [["r0", "r1"], ["r2", "r3"], ["r4"]]
    assert any(others for _, others in joins(runs["continuous"]))  # joins a running batch
    assert all(len(rec.rows) == 1 for rec in runs["none"].executor.history)
    steps = {m: h.scheduler.stats.num_steps for m, h in runs.items()}
    assert steps["continuous"] < steps["static"] < steps["none"]


def test_priority_policy_admits_by_priority_and_preempts_the_lowest() -> None:
    cfg = make_config(policy="priority", max_slots=1, max_num_seqs=1)
    h = Harness(cfg)
    low = make_request("low", [1, 2], max_tokens=2, priority=5, arrival_time=0, ignore_eos=True)
    high = make_request("high", [3, 4], max_tokens=2, priority=0, arrival_time=1, ignore_eos=True)
    h.add(low, high)
    h.step()
    assert [c.request_id for c in h.last_plan.chunks] == ["high"]
    h.run()
    assert h.outputs() == {"low": expected(low, cfg), "high": expected(high, cfg)}

    tight = Harness(
        make_config(policy="priority", num_blocks=4, max_slots=2, enable_prefix_caching=False)
    )
    early_low = make_request(
        "early_low", [1, 2, 3, 4], max_tokens=8, priority=1, arrival_time=0, ignore_eos=True
    )
    late_high = make_request(
        "late_high", [5, 6, 7, 8], max_tokens=8, priority=0, arrival_time=1, ignore_eos=True
    )
    tight.add(early_low, late_high)
    tight.run()
    assert early_low.metrics.num_preemptions == 1 and late_high.metrics.num_preemptions == 0


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room() -> None:
    cfg = make_config(enable_chunked_prefill=False, max_num_batched_tokens=64, num_blocks=32)
    h = Harness(cfg)
    a = make_request("a", list(range(1, 41)), max_tokens=3, ignore_eos=True)
    b = make_request("b", list(range(2, 42)), max_tokens=3, ignore_eos=True)
    h.add(a, b)
    h.step()
    assert [(c.request_id, len(c.token_ids)) for c in h.last_plan.chunks] == [("a", 40)]
    h.step()
    assert [(c.request_id, len(c.token_ids)) for c in h.last_plan.chunks] == [("a", 1), ("b", 40)]
    h.run()
    assert h.outputs() == {"a": expected(a, cfg), "b": expected(b, cfg)}


def test_long_prefill_threshold_lets_prompts_share_a_step() -> None:
    h = Harness(make_config(long_prefill_token_threshold=8))
    h.add(make_request("a", list(range(1, 21))), make_request("b", list(range(2, 22))))
    h.step()
    assert [
        (c.request_id, c.start_pos, len(c.token_ids), c.sample) for c in h.last_plan.chunks
    ] == [
        ("a", 0, 8, False),
        ("b", 0, 8, False),
    ]


def test_stop_token_eos_and_logprobs_in_updates() -> None:
    cfg = make_config()
    h = Harness(cfg)
    probe = make_request("probe", [1, 2, 3], max_tokens=3, ignore_eos=True)
    first = expected(probe, cfg)[0]
    h.add(make_request("stop", [1, 2, 3], max_tokens=5, stop_token_ids=[first], logprobs=1))
    (u,) = h.step()
    assert u.finished and u.finish_reason == "stop" and u.stop_reason == first
    assert u.new_token_ids == (first,) and [lp.token_id for lp in u.new_logprobs] == [first]
    assert h.scheduler.stats.num_kv_blocks_used == 0


def test_impossible_requests_and_configs_are_refused() -> None:
    s = make_scheduler(make_config(num_blocks=4, max_model_len=64))
    with pytest.raises(ValueError, match="max_model_len"):
        s.add_request(make_request("a", [1] * 65))
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("a", [1] * 10, max_tokens=20))  # 29 KV tokens > 16
    s.add_request(make_request("a", [1] * 10, max_tokens=7))  # 16 KV tokens: fits exactly
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("a", [1]))
    for field, bad in (("max_num_seqs", 0), ("policy", "lifo"), ("mode", "dynamic")):
        with pytest.raises(SchedulerConfigError) as err:
            make_config(**{field: bad})
        assert err.value.field == field
    with pytest.raises(SchedulerConfigError, match="max_model_len"):
        make_config(enable_chunked_prefill=False, max_num_batched_tokens=32)


# -- paged layout: block tables instead of copies ------------------------------------------------


def test_a_paged_plan_carries_block_tables_and_registers_full_blocks_after_the_step() -> None:
    h = Harness(make_config(paged=True, block_size=4, max_num_batched_tokens=32))
    shared = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks
    h.add(make_request("a", [*shared, 9], max_tokens=3))
    plan = h.scheduler.schedule()
    (chunk,) = plan.chunks
    assert chunk.block_table == tuple(h.scheduler.kv.block_ids("a")) and len(chunk.block_table) == 3
    assert not plan.kv_loads and not plan.kv_saves
    # the prompt's two full blocks are not in the prefix cache until the step has run
    assert h.scheduler.kv.find_prefix([*shared, 10]).num_tokens == 0
    h.scheduler.update(plan, h.executor.execute(plan))
    assert h.scheduler.kv.find_prefix([*shared, 10]).block_ids == chunk.block_table[:2]
    h.add(make_request("b", [*shared, 10], max_tokens=3))
    h.step()
    kv = h.scheduler.kv
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]  # the same physical blocks
    assert [kv.pool.ref_cnt(b) for b in kv.block_ids("a")[:2]] == [2, 2]
    h.run()
    assert h.outputs() == run_alone_outputs([make_request("a", [*shared, 9], max_tokens=3),
                                             make_request("b", [*shared, 10], max_tokens=3)],
                                            h.config)
