"""DynamicBatcher as a pure data structure: a recording batch function, gates instead of sleeps."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest

from inferflow.embeddings.dynamic_batcher import (
    BatcherClosed,
    DynamicBatcher,
    QueueFull,
    WorkerState,
)
from inferflow.stages.batching import DynamicBatching

WAIT = 10.0  # generous upper bound for event waits; tests never wait on time itself


class Recorder:
    """batch_fn that records each batch; blocks while ``gate`` is closed; ``entered`` per call."""

    def __init__(self, gated: bool = False) -> None:
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        if not gated:
            self.gate.set()

    def __call__(self, items: list[str]) -> list[str]:
        self.batches.append(list(items))
        self.entered.set()
        assert self.gate.wait(WAIT), "test gate never opened"
        return [item.upper() for item in items]


def make_batcher(
    fn: Recorder, *, length_fn: bool = False, **cfg: object
) -> DynamicBatcher[str, str]:
    config = DynamicBatching(**{"max_delay_ms": 0.0, **cfg})  # type: ignore[arg-type]
    return DynamicBatcher(fn, config, length_fn=len if length_fn else None)


def hold_worker(batcher: DynamicBatcher[str, str], rec: Recorder) -> None:
    """Put one 'blocker' batch into the (gated) batch function so later submits queue up."""
    batcher.submit("blocker")
    assert rec.entered.wait(WAIT)


def test_32_concurrent_submitters_form_batches_larger_than_one() -> None:
    rec = Recorder(gated=True)
    with make_batcher(rec, max_num_seqs=8, max_delay_ms=2.0) as batcher:
        hold_worker(batcher, rec)
        start = threading.Barrier(32)
        futures: dict[int, object] = {}

        def client(i: int) -> None:
            start.wait()
            futures[i] = batcher.submit(f"req{i}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rec.gate.set()
        results = {i: f.result(WAIT) for i, f in futures.items()}  # type: ignore[attr-defined]
        stats = batcher.stats()
    assert results == {i: f"REQ{i}" for i in range(32)}
    assert stats.items_processed == 33
    assert stats.batch_size_histogram == {1: 1, 8: 4}  # the blocker, then four full batches
    assert stats.batches_formed == 5
    assert stats.max_queue_depth == 32


def test_bounded_queue_rejects_when_full_and_admits_all_or_nothing() -> None:
    rec = Recorder(gated=True)
    with make_batcher(rec, max_num_seqs=4, max_queue_size=3) as batcher:
        hold_worker(batcher, rec)
        queued = [batcher.submit(x) for x in ("a", "b")]
        with pytest.raises(QueueFull):
            batcher.submit_many(["c", "d"])  # 2 + 2 > 3: neither is queued
        assert batcher.stats().queue_depth == 2
        queued.append(batcher.submit("c"))
        with pytest.raises(QueueFull, match="max_queue_size=3"):
            batcher.submit("d")
        stats = batcher.stats()
        assert (stats.queue_depth, stats.rejected) == (3, 3)
        rec.gate.set()
        assert [f.result(WAIT) for f in queued] == ["A", "B", "C"]
    assert rec.batches == [["blocker"], ["a", "b", "c"]]


def test_idle_worker_is_parked_in_an_untimed_wait() -> None:
    rec = Recorder()
    with make_batcher(rec) as batcher:
        assert batcher.wait_idle(WAIT)
        stats = batcher.stats()
        assert stats.worker_state is WorkerState.IDLE
        assert stats.worker_wakeups == 0  # never woke up: no polling loop
        assert batcher.submit("x").result(WAIT) == "X"
        assert batcher.wait_idle(WAIT)
        stats = batcher.stats()
        # exactly one wake-up (the submit's notify) served the whole request
        assert (stats.worker_state, stats.worker_wakeups) == (WorkerState.IDLE, 1)


def test_length_buckets_group_similar_lengths() -> None:
    rec = Recorder(gated=True)
    with make_batcher(rec, length_fn=True, bucket_boundaries=(8, 64)) as batcher:
        hold_worker(batcher, rec)
        words = ["aa", "b" * 40, "ccc", "d" * 100, "e" * 7]
        futures = batcher.submit_many(words)
        rec.gate.set()
        assert [f.result(WAIT) for f in futures] == [w.upper() for w in words]
    # the oldest item's bucket goes first, then the next oldest head: no 100-char padding
    assert rec.batches[1:] == [["aa", "ccc", "e" * 7], ["b" * 40], ["d" * 100]]


def test_full_bucket_is_dispatched_before_older_partial_one() -> None:
    rec = Recorder(gated=True)
    with make_batcher(rec, length_fn=True, bucket_boundaries=[8], max_num_seqs=2) as batcher:
        hold_worker(batcher, rec)
        futures = batcher.submit_many(["x" * 20, "s1", "s2", "s3"])
        rec.gate.set()
        for f in futures:
            f.result(WAIT)
    assert rec.batches[1:] == [["s1", "s2"], ["x" * 20], ["s3"]]


def test_batch_errors_reach_every_waiter_and_worker_survives() -> None:
    def fn(items: list[str]) -> Sequence[str]:
        if "boom" in items:
            raise KeyError("boom")
        if "short" in items:
            return []
        return items

    with DynamicBatcher(fn, DynamicBatching(max_delay_ms=0.0)) as batcher:
        with pytest.raises(KeyError):
            batcher.submit("boom").result(WAIT)
        with pytest.raises(RuntimeError, match="0 results for 1 items"):
            batcher.submit("short").result(WAIT)
        assert batcher.submit("ok").result(WAIT) == "ok"


def test_cancelled_items_are_skipped() -> None:
    rec = Recorder(gated=True)
    with make_batcher(rec) as batcher:
        hold_worker(batcher, rec)
        keep, drop = batcher.submit_many(["keep", "drop"])
        assert drop.cancel()
        rec.gate.set()
        assert keep.result(WAIT) == "KEEP"
        assert batcher.wait_idle(WAIT)
        assert batcher.stats().cancelled == 1
    assert rec.batches == [["blocker"], ["keep"]]


def test_close_fails_queued_items_and_rejects_new_ones() -> None:
    rec = Recorder(gated=True)
    batcher = make_batcher(rec)
    hold_worker(batcher, rec)
    queued = batcher.submit("late")
    closer = threading.Thread(target=batcher.close)
    closer.start()
    with pytest.raises(BatcherClosed):
        queued.result(WAIT)
    with pytest.raises(BatcherClosed):
        batcher.submit("after")
    rec.gate.set()  # the running batch still completes
    closer.join(WAIT)
    assert batcher.stats().worker_state is WorkerState.STOPPED


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_delay_ms", 10.5), ("max_delay_ms", -1.0), ("max_num_seqs", 0), ("max_queue_size", 0)],
)
def test_config_rejects_out_of_range_values(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        DynamicBatching(**{field: value})  # type: ignore[arg-type]


def test_config_accepts_delay_bounds() -> None:
    assert DynamicBatching(max_delay_ms=0).max_delay_ms == 0
    assert DynamicBatching(max_delay_ms=10).max_delay_ms == 10
