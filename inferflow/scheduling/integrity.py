"""Consistency checks of a scheduler's bookkeeping (tests run ``check_scheduler`` after every
step)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from inferflow.scheduling.request import RequestStatus

if TYPE_CHECKING:
    from inferflow.scheduling.scheduler import Scheduler

def check_scheduler(scheduler: Scheduler) -> None:
    """Raise AssertionError if ``scheduler``'s requests, KV manager, pool or slots disagree
    (tests call it after every step)."""
    scheduler.kv.check_integrity()
    scheduler.slots.check_integrity()
    assert len(scheduler.running) <= scheduler.max_running
    assert {r.slot for r in scheduler.running} == set(scheduler.slots.used), "slot bookkeeping"
    for r in scheduler.running:
        assert r.status == RequestStatus.RUNNING and 0 < r.num_computed_tokens <= r.num_tokens
        assert len(scheduler.kv.block_ids(r.request_id)) == scheduler.kv.num_blocks_for(
            r.num_computed_tokens
        )
        assert r.num_computed_tokens <= scheduler.layout.max_model_len
        freed = len(scheduler.kv.block_ids(r.request_id)) - scheduler.kv.num_held_blocks(
            r.request_id
        )
        assert freed <= scheduler.kv.num_dead_blocks(r.num_computed_tokens), (
            f"{r.request_id}: a block within the window was freed"
        )
    for r in scheduler.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), r.status
        assert r.slot is None and r.num_computed_tokens == 0 and not scheduler.kv.holds(r.request_id)
    loras = [r.lora for r in scheduler.running if r.lora is not None]
    if scheduler.max_loras is not None:  # multi-LoRA: the engine's slots hold every adapter
        assert len(set(loras)) <= scheduler.max_loras, f"adapters {sorted(set(loras))} running"
    assert scheduler.running_loras == set(loras), "adapter bookkeeping"
    live = [r.request_id for r in itertools.chain(scheduler.running, scheduler.waiting)]
    assert sorted(live) == sorted(scheduler._requests) == sorted(scheduler._keys), "a request got lost"
