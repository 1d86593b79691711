"""Scheduler side of issue 40: ``prompt_leader`` (n > 1 siblings compute their prompt once),
``max_tokens=0`` (prefill only) and prompt logprobs (every chunk's positions, no prefix hits),
on the fake executor that simulates KV content, in the slot and paged layouts."""

from __future__ import annotations

import pytest
from fake_executor import reference_prompt_logprobs
from sched_factories import VOCAB, Harness, expected, make_config, make_request

from inferflow.scheduling.request import Request, RequestStatus

PROMPT = list(range(5, 19))  # 14 tokens: 3 full blocks of 4 and a partial one


def leader_and_siblings(n: int, **params: object) -> list[Request]:
    lead = make_request("lead", PROMPT, max_tokens=5, ignore_eos=True, **params)
    siblings = []
    for i in range(1, n):
        request = make_request(f"sib{i}", PROMPT, max_tokens=5, ignore_eos=True, **params)
        request.prompt_leader = "lead"
        siblings.append(request)
    return [lead, *siblings]


@pytest.mark.parametrize("paged", [False, True])
def test_siblings_wait_for_the_leader_and_read_its_prompt_from_the_cache(paged: bool) -> None:
    cfg = make_config(paged=paged, max_num_batched_tokens=8)  # the prompt takes 2 chunks
    h = Harness(cfg)
    requests = leader_and_siblings(3)
    h.add(*requests)
    h.step()  # the leader's first chunk only: the siblings wait, they do not share its budget
    assert set(h.last_plan.chunks[i].request_id for i in range(len(h.last_plan.chunks))) == {"lead"}
    h.run()
    outputs = h.outputs()
    assert all(outputs[r.request_id] == expected(r, cfg) for r in requests)
    full = (len(PROMPT) - 1) // cfg.block_size * cfg.block_size  # 12: 3 blocks
    cached = {r.request_id: r.metrics.num_cached_prompt_tokens for r in requests}
    assert cached == {"lead": 0, "sib1": full, "sib2": full}
    # the prompt was computed once, then only each sibling's tail: 14 + 2 x 2, and the decodes
    decodes = sum(len(o) - 1 for o in outputs.values())
    assert h.scheduler.stats.num_scheduled_tokens == len(PROMPT) + 2 * (len(PROMPT) - full) + decodes


def test_a_waiting_sibling_blocks_nobody_behind_it() -> None:
    h = Harness(make_config(max_num_batched_tokens=8))
    lead, sibling = leader_and_siblings(2)
    other = make_request("other", [40, 41, 42], max_tokens=2, ignore_eos=True)
    h.add(lead, sibling, other)
    h.step()
    assert [c.request_id for c in h.last_plan.chunks] == ["lead"]  # the budget went to it
    h.step()  # the leader's last chunk (6 tokens) and the other request; the sibling waits
    assert [c.request_id for c in h.last_plan.chunks] == ["lead", "other"]
    h.step()  # the leader's prompt is computed: the sibling starts, reading its blocks
    assert "sib1" in [c.request_id for c in h.last_plan.chunks]
    assert sibling.metrics.num_cached_prompt_tokens == 12


@pytest.mark.parametrize("leader", ["unknown", "finished"])
def test_a_sibling_whose_leader_is_gone_just_runs(leader: str) -> None:
    h = Harness(make_config())
    sibling = make_request("sib", PROMPT, max_tokens=2, ignore_eos=True)
    sibling.prompt_leader = "lead"
    if leader == "finished":
        lead = make_request("lead", PROMPT, max_tokens=2, ignore_eos=True)
        h.add(lead)
        h.scheduler.finish_requests(["lead"], RequestStatus.FINISHED_ABORTED)
    h.add(sibling)
    h.step()
    assert [c.request_id for c in h.last_plan.chunks] == ["sib"]


def test_without_the_prefix_cache_siblings_do_not_wait() -> None:
    h = Harness(make_config(enable_prefix_caching=False, max_num_batched_tokens=64))
    requests = leader_and_siblings(3)
    h.add(*requests)
    h.step()
    assert len(h.last_plan.chunks) == 3
    h.run()
    assert all(h.outputs()[r.request_id] == expected(r, h.config) for r in requests)


@pytest.mark.parametrize("paged", [False, True])
def test_max_tokens_zero_computes_the_prompt_and_samples_nothing(paged: bool) -> None:
    h = Harness(make_config(paged=paged, max_num_batched_tokens=8))
    request = make_request("p", PROMPT, max_tokens=0)
    h.add(request)
    h.run()
    assert not any(c.sample for plan in h.executor.plans for c in plan.chunks)
    assert sum(len(c.token_ids) for plan in h.executor.plans for c in plan.chunks) == len(PROMPT)
    assert request.output_token_ids == [] and request.finish_reason == "length"
    final = [u for step in h.updates for u in step]
    assert [(u.new_token_ids, u.finish_reason) for u in final] == [((), "length")]
    assert h.scheduler.stats.num_kv_blocks_used == 0
    assert h.scheduler.stats.num_kv_blocks_cached == len(PROMPT) // 4  # kept for others
    h.add(again := make_request("again", PROMPT, max_tokens=1))
    h.run()
    assert again.metrics.num_cached_prompt_tokens == 12


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("max_tokens", [0, 3])
def test_prompt_logprobs_cover_every_chunk_and_take_no_cache_hits(paged: bool,
                                                                  max_tokens: int) -> None:
    cfg = make_config(paged=paged, max_num_batched_tokens=5)  # chunks of 5, 5 and 4 tokens
    h = Harness(cfg)
    warm = make_request("warm", PROMPT, max_tokens=1)  # caches the prompt's blocks
    h.add(warm)
    h.run()
    request = make_request("p", PROMPT, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=1)
    sibling = make_request("s", PROMPT, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=1)
    sibling.prompt_leader = "p"  # computing prompt logprobs itself: it does not wait
    h.add(request, sibling)
    h.step()
    assert {c.request_id for c in h.last_plan.chunks} == {"p"}  # the budget: 5 tokens
    h.run()
    want = reference_prompt_logprobs(PROMPT, VOCAB)
    for r in (request, sibling):
        got = r.prompt_logprobs
        assert got is not None and got[0] is None
        assert [e.logprob for e in got[1:]] == want[1:]  # type: ignore[union-attr]
        assert [e.token_id for e in got[1:]] == PROMPT[1:]  # type: ignore[union-attr]
        assert r.metrics.num_cached_prompt_tokens == 0
        if max_tokens:
            assert r.output_token_ids == expected(r, cfg)
    assert warm.prompt_logprobs is None


@pytest.mark.parametrize("paged", [False, True])
def test_prompt_logprobs_survive_preemption(paged: bool) -> None:
    """Few blocks: prefills and decodes preempt each other; a request preempted before its
    first token recomputes its prompt logprobs, after it keeps them (and may take hits)."""
    cfg = make_config(paged=paged, num_blocks=10, max_num_batched_tokens=6)
    h = Harness(cfg)
    prompts = [[7 + i + j for j in range(14)] for i in range(3)]
    requests = [make_request(f"r{i}", p, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
                for i, p in enumerate(prompts)]
    h.add(*requests)
    h.run()
    assert h.scheduler.stats.num_preemptions > 0
    for r, prompt in zip(requests, prompts, strict=True):
        assert r.output_token_ids == expected(r, cfg)
        got = r.prompt_logprobs
        assert got is not None
        assert [None if e is None else e.logprob for e in got] == \
            reference_prompt_logprobs(prompt, VOCAB)
