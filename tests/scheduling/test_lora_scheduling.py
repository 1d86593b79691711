"""Multi-LoRA in the scheduler: at most ``max_loras`` distinct adapters among the running
requests (admission skips a request whose adapter would be one too many, others go ahead), the
cap holds through preemption, and prefix-cache blocks are never shared across adapters.
``check_scheduler`` (run by the harness after every step) asserts the cap too."""

from __future__ import annotations

import pytest
from sched_factories import Harness, expected, make_config, make_request, make_scheduler

from inferflow.scheduling.integrity import check_scheduler

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # two full blocks of 4 + 1


def _plan_adapters(h: Harness) -> list[set[str]]:
    """The adapters of each executed plan's chunks."""
    return [{c.lora for c in plan.chunks if c.lora is not None} for plan in h.executor.plans]


@pytest.mark.parametrize("max_loras", [1, 2])
def test_running_adapters_never_exceed_max_loras(max_loras: int) -> None:
    cfg = make_config(max_num_seqs=8, max_slots=8, num_blocks=64, max_num_batched_tokens=128)
    h = Harness(cfg, max_loras=max_loras)
    requests = [make_request(f"{name}{i}", [i + 1, *PROMPT], max_tokens=5, ignore_eos=True,
                             lora=name)
                for i in range(2) for name in ("a", "b", "c")]
    requests += [make_request("base", PROMPT, max_tokens=5, ignore_eos=True)]
    h.add(*requests)
    h.step()
    first = {c.request_id for c in h.last_plan.chunks}
    # the first max_loras adapters in queue order run, both of their requests; the base request
    # behind the skipped ones goes ahead of them
    admitted = {"a": {"a0", "a1"}, "b": {"b0", "b1"}}
    want = {"base"}.union(*(admitted[n] for n in ("a", "b")[:max_loras]))
    assert first == want
    h.run()
    assert all(len(names) <= max_loras for names in _plan_adapters(h))
    assert set().union(*_plan_adapters(h)) == {"a", "b", "c"}  # every adapter ran eventually
    for r in requests:  # (the fake's output depends on the KV content only)
        assert h.finished[r.request_id].output_token_ids == expected(r, cfg)


def test_a_waiting_adapter_is_admitted_once_a_running_one_finishes() -> None:
    cfg = make_config(max_num_seqs=4, max_slots=4)
    h = Harness(cfg, max_loras=1)
    a = make_request("a", PROMPT, max_tokens=2, ignore_eos=True, lora="a")
    b = make_request("b", PROMPT, max_tokens=2, ignore_eos=True, lora="b")
    h.add(a, b)
    h.step()
    assert h.scheduler.running_loras == {"a"}
    stats = h.scheduler.stats
    assert (stats.running_loras, stats.waiting_loras, stats.max_loras) == (("a",), ("b",), 1)
    h.step()  # a decodes its last token and finishes
    assert a.is_finished and h.scheduler.running_loras == set()
    h.step()
    assert h.scheduler.running_loras == {"b"}
    h.run()
    assert b.output_token_ids == expected(b, cfg)


@pytest.mark.parametrize("paged", [False, True])
def test_preemption_keeps_the_cap(paged: bool) -> None:
    # too few blocks for everyone: decodes preempt the requests behind them, which re-admit
    # under the cap (the harness checks it after every step)
    cfg = make_config(max_num_seqs=6, max_slots=6, num_blocks=12, paged=paged)
    h = Harness(cfg, max_loras=2)
    requests = [make_request(f"r{i}", [i + 1, *PROMPT], max_tokens=12, ignore_eos=True,
                             lora=(None, "a", "b", "c")[i % 4]) for i in range(8)]
    h.add(*requests)
    h.run()
    assert h.scheduler.stats.num_preemptions > 0
    assert all(len(names) <= 2 for names in _plan_adapters(h))
    for r in requests:
        assert h.finished[r.request_id].output_token_ids == expected(r, cfg)


@pytest.mark.parametrize("paged", [False, True])
def test_prefix_cache_blocks_are_never_shared_across_adapters(paged: bool) -> None:
    cfg = make_config(num_blocks=32, paged=paged)
    h = Harness(cfg, max_loras=4)
    first = [make_request(f"{n}1", PROMPT, max_tokens=1, lora=n) for n in ("a", "b")]
    first.append(make_request("base1", PROMPT, max_tokens=1))
    h.add(*first)
    h.run()  # every prompt's two full blocks are cached, keyed by adapter
    again = {n: make_request(f"{n}2", PROMPT, max_tokens=1, lora=n) for n in ("a", "b", "c")}
    again["base"] = make_request("base2", PROMPT, max_tokens=1)
    h.add(*again.values())
    h.step()
    cached = {n: r.metrics.num_cached_prompt_tokens for n, r in again.items()}
    assert cached == {"a": 8, "b": 8, "c": 0, "base": 8}  # c: no block of another adapter's
    if paged:  # the running tables: a hit shares its own adapter's blocks only
        tables = {n: set(h.scheduler.kv.block_ids(r.request_id)) for n, r in again.items()}
        for x in tables:
            for y in tables:
                assert x == y or not tables[x] & tables[y], (x, y)
    assert again["c"].cache_extra_keys == ("lora", "c") and again["base"].cache_extra_keys == ()


def test_an_adapter_request_needs_an_engine_with_lora() -> None:
    scheduler = make_scheduler(make_config())
    with pytest.raises(ValueError, match="serves no adapters"):
        scheduler.add_request(make_request("a", PROMPT, lora="a"))
    with pytest.raises(ValueError, match="max_loras"):
        make_scheduler(make_config(), max_loras=0)
    check_scheduler(scheduler)


def test_chunks_carry_their_request_adapter() -> None:
    h = Harness(make_config(), max_loras=2)
    h.add(make_request("a", PROMPT, max_tokens=2, lora="a"), make_request("base", PROMPT,
                                                                          max_tokens=2))
    h.step()
    assert {c.request_id: c.lora for c in h.last_plan.chunks} == {"a": "a", "base": None}
