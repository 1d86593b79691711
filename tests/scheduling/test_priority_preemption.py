"""``policy=priority``: a waiting request that outranks a running one (lower value) and lacks a
slot or KV blocks preempts it; the victim resumes later with the output it would have had alone
(the fake executor simulates KV content, so a wrong resume changes the tokens). Under ``fcfs``
a non-default priority is refused, not ignored."""

from __future__ import annotations

import pytest
from sched_factories import Harness, expected, make_config, make_request

from inferflow.scheduling import SchedulerConfig
from inferflow.scheduling.priority import honours_priority
from inferflow.stages.batching import BatchingStage, ContinuousBatching


def test_a_high_priority_arrival_takes_the_only_slot_from_a_running_request() -> None:
    cfg = make_config(policy="priority", max_slots=1, max_num_seqs=1)
    h = Harness(cfg)
    low = make_request("low", [1, 2, 3], max_tokens=6, priority=5, ignore_eos=True)
    h.add(low)
    h.step(), h.step(), h.step()  # prefill + two decodes
    assert len(low.output_token_ids) == 3
    high = make_request("high", [7, 8], max_tokens=3, priority=0, arrival_time=1, ignore_eos=True)
    h.add(high)
    h.step()
    plan = h.last_plan
    assert [(c.request_id, c.start_pos) for c in plan.chunks] == [("high", 0)]
    assert plan.preempted_request_ids == {"low"}
    assert low.metrics.num_preemptions == 1 and len(low.output_token_ids) == 3  # output kept
    h.run()
    assert h.outputs() == {"low": expected(low, cfg), "high": expected(high, cfg)}
    assert high.metrics.num_preemptions == 0


def test_a_high_priority_arrival_frees_kv_blocks_by_preempting_the_lowest() -> None:
    # 6 blocks of 4 tokens, 3 slots: two 9-token prompts hold 3 blocks each, the pool is full
    cfg = make_config(policy="priority", num_blocks=6, max_slots=3, enable_prefix_caching=False)
    h = Harness(cfg)
    mid = make_request("mid", range(1, 10), max_tokens=3, priority=1, ignore_eos=True)
    low = make_request("low", range(11, 20), max_tokens=3, priority=2, ignore_eos=True)
    h.add(mid, low)
    h.step()
    assert h.scheduler.kv.pool.num_free_blocks == 0
    high = make_request("high", [30, 31, 32], max_tokens=2, priority=0, arrival_time=1,
                        ignore_eos=True)
    h.add(high)
    h.step()
    assert h.last_plan.preempted_request_ids == {"low"}  # the lowest, not mid
    assert "high" in [c.request_id for c in h.last_plan.chunks]
    h.run()
    assert h.outputs() == {r.request_id: expected(r, cfg) for r in (mid, low, high)}
    assert (mid.metrics.num_preemptions, high.metrics.num_preemptions) == (0, 0)


@pytest.mark.parametrize(("policy", "arrival_priority"), [("priority", 5), ("fcfs", 0)])
def test_no_preemption_for_an_equal_priority_or_under_fcfs(
    policy: str, arrival_priority: int
) -> None:
    cfg = make_config(policy=policy, max_slots=1, max_num_seqs=1)
    h = Harness(cfg)
    first = make_request("first", [1, 2, 3], max_tokens=4, priority=arrival_priority,
                         ignore_eos=True)
    h.add(first)
    h.step()
    second = make_request("second", [4, 5], max_tokens=2, priority=arrival_priority,
                          arrival_time=1, ignore_eos=True)
    h.add(second)
    h.run()
    assert first.metrics.num_preemptions == 0
    assert h.outputs() == {"first": expected(first, cfg), "second": expected(second, cfg)}


def test_only_orders_that_read_priority_honour_it() -> None:
    assert not honours_priority(SchedulerConfig(policy="fcfs"))
    assert honours_priority(SchedulerConfig(policy="priority"))
    assert not ContinuousBatching().honours_priority  # the default policy: fcfs
    assert ContinuousBatching(policy="priority").honours_priority  # type: ignore[arg-type]

    class OwnOrder(ContinuousBatching):
        def sort_key(self, request, seq):  # type: ignore[no-untyped-def]
            return (request.priority, seq)

    assert OwnOrder().honours_priority  # a plugin's order is trusted
    assert BatchingStage.sort_key is not OwnOrder.sort_key
    assert honours_priority(object())  # an order object that does not say: trusted


# --- the engine, offline, on a real (tiny, random-weight) checkpoint -------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
    try:
        from engine_factories import make_named_checkpoint
    finally:
        sys.path.pop(0)
    return make_named_checkpoint(tmp_path_factory.mktemp("priority"), "gqa8x2")


def test_the_engine_refuses_a_priority_fcfs_would_ignore(checkpoint) -> None:  # type: ignore[no-untyped-def]
    from inferflow import LLM, SamplingParams
    from inferflow.engine.llm_engine import RequestRejected

    llm = LLM(checkpoint, max_slots=2, max_model_len=256)  # batching.policy: fcfs (default)
    with pytest.raises(RequestRejected, match=r"batching\.policy=priority") as info:
        llm.engine.add_request("p", [1, 2, 3], SamplingParams(max_tokens=2), priority=5)
    assert info.value.field == "priority" and not llm.engine.has_unfinished_requests()
    llm.engine.add_request("d", [1, 2, 3], SamplingParams(max_tokens=2), priority=0)
    assert llm.engine.has_unfinished_requests()


def test_the_engine_preempts_for_priority_and_keeps_greedy_outputs(checkpoint) -> None:  # type: ignore[no-untyped-def]
    from inferflow import LLM, SamplingParams

    llm = LLM(checkpoint, max_slots=1, max_num_seqs=1, max_model_len=256, policy="priority")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {"low": [5, 6, 7, 8, 9], "high": [11, 12, 13]}
    alone = {rid: llm.generate([p], greedy)[0].outputs[0].token_ids for rid, p in prompts.items()}
    engine = llm.engine
    engine.add_request("low", prompts["low"], greedy, priority=3)
    early = [out for _ in range(4) for out in engine.step()]  # low prefills, decodes a few
    assert len(early[-1].outputs[0].token_ids) >= 3  # (outputs are cumulative)
    engine.add_request("high", prompts["high"], greedy, priority=0)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = list(out.outputs[0].token_ids)
    assert list(final) == ["high", "low"]  # high took low's only slot, finished first
    assert engine.stats().num_preemptions == 1
    assert final == {rid: list(ids) for rid, ids in alone.items()}  # low resumed where it was
