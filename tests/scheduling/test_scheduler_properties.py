"""Property: random arrivals, lengths, cancellations and tight memory never leak a block, never lose
a request, and every request that is not cancelled ends with its full reference output."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from sched_factories import (
    EOS,
    Harness,
    OracleProposer,
    TinyConfig,
    expected,
    make_config,
    make_request,
)

from inferflow.scheduling import Request, RequestStatus
from inferflow.scheduling.config import max_chunk
from inferflow.scheduling.integrity import check_scheduler
from inferflow.scheduling.layout import window_blocks


@dataclass
class Arrival:
    request: Request
    step: int
    cancel_step: int | None


@st.composite
def configs(draw: st.DrawFn) -> TinyConfig:
    block_size = draw(st.sampled_from([2, 3, 4]))
    num_blocks = draw(st.integers(4, 12))
    # mostly max_model_len <= pool size, so long requests get capped rather than refused
    max_model_len = draw(st.integers(6, num_blocks * block_size + 4))
    max_slots, max_num_seqs = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    chunked = draw(st.booleans())
    lowest = max(min(max_slots, max_num_seqs), 4) if chunked else max_model_len
    return make_config(
        block_size=block_size,
        num_blocks=num_blocks,
        max_slots=max_slots,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=draw(st.integers(lowest, lowest + 20)),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        mode=draw(st.sampled_from(["continuous", "continuous", "static", "none"])),
    )


@st.composite
def arrivals(draw: st.DrawFn, min_requests: int = 1) -> list[Arrival]:
    tokens = st.integers(1, 8)  # small alphabet: shared prefixes happen; EOS (0) only if sampled
    prefixes = draw(st.lists(st.lists(tokens, max_size=9), min_size=1, max_size=3))
    out = []
    for i in range(draw(st.integers(min_requests, 8))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(tokens, min_size=1, max_size=7))
        max_tokens = draw(st.integers(1, 16))
        request = make_request(
            f"r{i}",
            prompt,
            max_tokens=max_tokens,
            arrival_time=float(i),
            priority=draw(st.integers(0, 2)),
            ignore_eos=draw(st.booleans()),
            min_tokens=draw(st.integers(0, max_tokens)),
            stop_token_ids=draw(st.lists(st.integers(1, 63), max_size=2)),
        )
        cancel = draw(st.none() | st.none() | st.integers(0, 30))
        out.append(Arrival(request, draw(st.integers(0, 6)), cancel))
    return out


@st.composite
def tight_configs(draw: st.DrawFn) -> TinyConfig:
    """Many slots, little memory (max_model_len = the whole pool): most workloads must preempt."""
    num_blocks = draw(st.integers(6, 10))
    return make_config(
        block_size=2,
        num_blocks=num_blocks,
        max_slots=draw(st.integers(3, 6)),
        max_num_seqs=6,
        max_model_len=2 * num_blocks,
        max_num_batched_tokens=draw(st.integers(6, 16)),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
    )


@st.composite
def windowed_configs(draw: st.DrawFn) -> TinyConfig:
    """A sliding-window model on a paged pool smaller than the context: requests longer than
    the pool run, since blocks behind the window are freed."""
    block_size = draw(st.sampled_from([2, 3, 4]))
    num_blocks = draw(st.integers(4, 10))
    max_slots, max_num_seqs = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    lowest = max(min(max_slots, max_num_seqs), 4)
    return make_config(
        block_size=block_size,
        num_blocks=num_blocks,
        max_slots=max_slots,
        max_num_seqs=max_num_seqs,
        max_model_len=draw(st.integers(num_blocks * block_size, 40)),
        max_num_batched_tokens=draw(st.integers(lowest, 10)),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3])),
        enable_prefix_caching=draw(st.booleans()),
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        paged=True,
        sliding_window=draw(st.integers(1, 9)),
    )


SETTINGS = settings(
    max_examples=120, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(cfg=configs(), plan=arrivals())
def test_random_workloads_finish_with_reference_outputs_and_no_leaks(
    cfg: TinyConfig, plan: list[Arrival]
) -> None:
    run_workload(cfg, plan)


@SETTINGS
@given(cfg=tight_configs(), plan=arrivals(min_requests=4))
def test_tight_memory_workloads_preempt_and_still_match(
    cfg: TinyConfig, plan: list[Arrival]
) -> None:
    run_workload(cfg, plan)


@SETTINGS
@given(cfg=configs(), plan=arrivals())
def test_paged_workloads_finish_with_reference_outputs_and_no_leaks(
    cfg: TinyConfig, plan: list[Arrival]
) -> None:
    """The same workloads with the KV in the pool's blocks (block tables, shared prefix blocks)."""
    run_workload(dataclasses.replace(cfg, paged=True), plan)


@SETTINGS
@given(cfg=tight_configs(), plan=arrivals(min_requests=4))
def test_paged_tight_memory_workloads_preempt_and_still_match(
    cfg: TinyConfig, plan: list[Arrival]
) -> None:
    run_workload(dataclasses.replace(cfg, paged=True), plan)


@SETTINGS
@given(cfg=configs(), plan=arrivals(), paged=st.booleans())
def test_speculative_workloads_match_the_reference(
    cfg: TinyConfig, plan: list[Arrival], paged: bool
) -> None:
    """With drafts (some right, some wrong) in decode rows, outputs are still the reference's:
    rejected drafts are rolled back in slots and paged blocks alike."""
    run_workload(dataclasses.replace(cfg, paged=paged), plan, OracleProposer())


@SETTINGS
@given(cfg=tight_configs(), plan=arrivals(min_requests=4), paged=st.booleans())
def test_speculative_tight_memory_workloads_still_match(
    cfg: TinyConfig, plan: list[Arrival], paged: bool
) -> None:
    run_workload(dataclasses.replace(cfg, paged=paged), plan, OracleProposer(4, 0.2))


@SETTINGS
@given(cfg=configs(), plan=arrivals(), window=st.integers(1, 9), paged=st.booleans())
def test_sliding_window_workloads_match_the_reference(
    cfg: TinyConfig, plan: list[Arrival], window: int, paged: bool
) -> None:
    """A windowed model (the fake hashes only what the window sees): paged, the blocks behind
    the window are freed and the outputs do not change; slots keep everything."""
    run_workload(dataclasses.replace(cfg, paged=paged, sliding_window=window), plan)


@SETTINGS
@given(cfg=windowed_configs(), plan=arrivals(min_requests=2), speculate=st.booleans())
def test_sliding_window_contexts_longer_than_the_pool_still_match(
    cfg: TinyConfig, plan: list[Arrival], speculate: bool
) -> None:
    run_workload(cfg, plan, OracleProposer(3, 0.3, cfg.sliding_window) if speculate else None)


@SETTINGS
@given(cfg=tight_configs(), plan=arrivals(min_requests=4), window=st.integers(1, 6))
def test_sliding_window_tight_memory_workloads_preempt_and_still_match(
    cfg: TinyConfig, plan: list[Arrival], window: int
) -> None:
    run_workload(dataclasses.replace(cfg, paged=True, sliding_window=window), plan,
                 OracleProposer(4, 0.2, window))


def run_workload(
    cfg: TinyConfig, plan: list[Arrival], proposer: OracleProposer | None = None
) -> None:
    h = Harness(cfg, proposer)
    accepted: list[Arrival] = []
    cancelled: set[str] = set()
    last_arrival = max(a.step for a in plan)
    t = 0
    while t <= last_arrival or h.scheduler.has_unfinished_requests():
        assert t < 3000, "a request got stuck"
        for a in plan:
            if a.step == t:
                add(h, cfg, a, accepted)
            if a.cancel_step == t and h.scheduler.finish_requests([a.request.request_id]):
                cancelled.add(a.request.request_id)
        check_scheduler(h.scheduler)
        h.step()
        t += 1

    stats = h.scheduler.stats
    event(f"preempted: {stats.num_preemptions > 0}")
    event(f"prefix hits: {stats.prefix_cache_hits > 0}")
    event(f"cancelled: {bool(cancelled)}")
    if proposer is not None:
        spec = h.scheduler.spec_stats
        event(f"drafts accepted: {spec.num_accepted_tokens > 0}, "
              f"rejected: {spec.num_accepted_tokens < spec.num_draft_tokens}")
    event(f"refused: {len(plan) - len(accepted)}")
    if cfg.layout.freeing_window is not None:
        null = cfg.num_blocks
        event(f"freed behind the window: "
              f"{any(null in c.block_table for p in h.executor.plans for c in p.chunks)}")
    assert stats.num_kv_blocks_used == 0 and stats.num_kv_blocks_free == cfg.num_blocks
    assert (
        stats.num_running == stats.num_waiting == 0 and h.scheduler.slots.num_free == cfg.max_slots
    )
    for a in accepted:
        r = a.request
        want = expected(r, cfg)
        if r.request_id in cancelled:
            assert r.status == RequestStatus.FINISHED_ABORTED
            assert r.output_token_ids == want[: r.num_output_tokens]
        else:
            assert r.output_token_ids == want, r.request_id
            assert h.finished[r.request_id] is r
            stopped = want[-1] in r.sampling_params.stop_token_ids or (
                want[-1] == EOS and not r.sampling_params.ignore_eos
            )
            assert r.finish_reason == (
                "stop" if stopped and len(want) >= r.sampling_params.min_tokens else "length"
            )


def add(h: Harness, cfg: TinyConfig, a: Arrival, accepted: list[Arrival]) -> None:
    r = a.request
    # paged under a window with chunked prefill, a request holds at most window_blocks at once
    window = cfg.layout.freeing_window
    bounded = window is not None and cfg.enable_chunked_prefill
    try:
        h.add(r)
    except ValueError:
        # refused only if it could never fit, even capped by max_model_len
        assert r.num_prompt_tokens > cfg.max_model_len or (
            r.num_prompt_tokens + r.sampling_params.max_tokens - 1 > cfg.num_blocks * cfg.block_size
        )
        if bounded and r.num_prompt_tokens <= cfg.max_model_len:
            assert window is not None
            need = window_blocks(window, cfg.block_size, max_chunk(cfg.budgets))
            assert need > cfg.num_blocks
        return
    accepted.append(a)
