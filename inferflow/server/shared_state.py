"""State every process of one server reads without a Manager round-trip.

Created in the main process before the engine worker is spawned (the object travels inside the
pickled LitAPI, which multiprocessing allows for synchronized values at spawn time) and before
the API processes are forked (they inherit the shared memory).

- ``ready``: the worker loaded its engine and ran a warm-up step; cleared when it dies.
- ``heartbeat``: when the engine thread last went round its loop (at least once a second).
- ``draining``: the supervisor received SIGTERM/SIGINT; new requests get 503.
- ``queue_lost``: the queue (Manager) process died; no request or cancellation can reach the
  worker any more, so in-flight requests fail at once instead of draining.
- ``in_flight``: admitted requests across all API processes (the waiting-queue bound).
- ``stats``: a snapshot the worker writes after every engine step (running, waiting, slots,
  KV blocks, counters) — what ``GET /admin/stats`` shows; zeroed by the main process when the
  worker exits (``clear_stats``: a dead worker's pid and counters are not live).
- ``info``: a JSON blob the worker writes once (engine and runtime versions, ``max_model_len``).
- ``executor``: a small JSON blob of the executor stage's own counters (``ExecutorStage.stats``),
  rewritten only when they change.
- ``lora``: a JSON blob of the worker's LoRA adapters (the source of truth: runtime loads happen
  there): ``{"adapters": [{"name", "path"}], "running": [...], "waiting": [...], "max_loras",
  "loads", "unloads", "updated_at"}``, rewritten only when it changes; ``{}`` before the worker
  published it (the API processes then use the configured ``lora.adapters``). When the worker
  exits (unloaded, crashed) only its ``adapters`` stay: the model still serves them, and its next
  worker restores exactly that list (runtime loads and unloads included) before it is ready.

With a model repository (``models:``) every LLM version has its own ``SharedState`` (the flags
above but ``draining``/``queue_lost`` then describe that model's worker), plus:

- ``load_state``: written by the main process (``ModelManager``): unloaded, loading, loaded,
  unloading or failed (the worker's error is in ``info()["load_error"]``);
- ``load_waiters``: requests waiting for this model to load (the main process loads a model
  while any wait; requests failed by a crash never wait, so they do not reload it);
- ``weight``: its share of unpinned traffic, changed at run time by the admin endpoint;
- ``last_used``: when a request last finished or arrived (least-recently-used unloading);
- ``memory_bytes``: what the main process counts it for against the memory budget;
- ``loads``/``unloads``: how many times the main process started / unloaded its worker.

Everything the engine worker writes is lock-free: the worker can be killed at any instruction
(SIGKILL, OOM), and a lock it held would then block every API process forever. Flags are single
bytes; the snapshot and the blob use a sequence number (a seqlock: odd while being written);
readers retry for a bounded time, then fall back to the last snapshot they saw. Only
``in_flight``, which API processes alone update, keeps a lock.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

STATS_FIELDS = (
    "running",  # requests in the running batch
    "waiting",  # requests queued inside the engine
    "free_slots",
    "total_slots",
    "kv_blocks_free",
    "kv_blocks_total",
    "num_steps",
    "prefix_cache_queries",  # prompt tokens looked up in the prefix cache
    "prefix_cache_hits",  # of which served from it
    "finished_requests",
    "aborted_requests",  # cancelled: client disconnected or frontend gave up
    "timed_out_requests",
    "worker_pid",
    "updated_at",  # time.time() of the snapshot
)
_INFO_BYTES = 16384


class LoadState:
    """Values of ``SharedState.load_state`` (one byte)."""

    UNLOADED = 0
    LOADING = 1
    LOADED = 2
    UNLOADING = 3
    FAILED = 4
    NAMES = ("unloaded", "loading", "loaded", "unloading", "failed")


LOAD_RETRY_S = 30.0  # a failed on-demand model is loaded again by a request after this long

_EXECUTOR_BYTES = 4096
_LORA_BYTES = 65536  # ~500 adapters with their paths


class SharedState:
    """Shared values; see the module docstring for what each one means and who writes it."""

    def __init__(self, weight: float = 1.0) -> None:
        ctx = mp.get_context("spawn")
        self._load_state = ctx.Value("b", LoadState.UNLOADED, lock=False)
        self._load_waiters = ctx.Value("i", 0)  # locked: API processes only
        self._memory = ctx.Value("d", 0.0, lock=False)
        self._loads = ctx.Value("q", 0, lock=False)  # single writer: the main process
        self._unloads = ctx.Value("q", 0, lock=False)
        self._weight = ctx.Value("d", weight, lock=False)
        self._last_used = ctx.Value("d", 0.0, lock=False)
        self._ready = ctx.Value("b", 0, lock=False)
        self._draining = ctx.Value("b", 0, lock=False)
        self._queue_lost = ctx.Value("b", 0, lock=False)
        self._in_flight = ctx.Value("i", 0)  # locked: API processes only
        self._stats = ctx.Array("d", 1 + len(STATS_FIELDS), lock=False)  # [seq, *fields]
        self._info_seq = ctx.Value("q", 0, lock=False)
        self._info = ctx.Array("c", _INFO_BYTES, lock=False)
        self._heartbeat = ctx.Value("d", 0.0, lock=False)  # time.time() of the last beat
        self._executor_seq = ctx.Value("q", 0, lock=False)
        self._executor = ctx.Array("c", _EXECUTOR_BYTES, lock=False)
        self._lora_seq = ctx.Value("q", 0, lock=False)
        self._lora = ctx.Array("c", _LORA_BYTES, lock=False)
        self._last_executor: dict[str, float] = {}  # writer side: skip unchanged blobs
        self._last_lora: dict[str, Any] = {}
        self._last_stats = [0.0] * len(STATS_FIELDS)  # per reading process

    # readiness / draining -------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return bool(self._ready.value)

    def set_ready(self, value: bool) -> None:
        self._ready.value = 1 if value else 0

    @property
    def draining(self) -> bool:
        return bool(self._draining.value)

    def set_draining(self) -> None:
        self._draining.value = 1

    @property
    def queue_lost(self) -> bool:
        return bool(self._queue_lost.value)

    def set_queue_lost(self) -> None:
        self._queue_lost.value = 1

    # model repository -----------------------------------------------------------------------
    @property
    def load_state(self) -> int:
        return int(self._load_state.value)

    def set_load_state(self, state: int) -> None:
        self._load_state.value = state

    @property
    def load_waiters(self) -> int:
        return int(self._load_waiters.value)

    def add_load_waiter(self, delta: int) -> None:
        with self._load_waiters.get_lock():
            self._load_waiters.value += delta

    @property
    def memory_bytes(self) -> int:
        return int(self._memory.value)

    def set_memory_bytes(self, value: int) -> None:
        self._memory.value = float(value)

    @property
    def loads(self) -> int:
        return int(self._loads.value)

    @property
    def unloads(self) -> int:
        return int(self._unloads.value)

    def count_load(self) -> None:
        self._loads.value += 1

    def count_unload(self) -> None:
        self._unloads.value += 1

    @property
    def weight(self) -> float:
        return float(self._weight.value)

    def set_weight(self, weight: float) -> None:
        self._weight.value = float(weight)

    @property
    def last_used(self) -> float:
        return float(self._last_used.value)

    def touch(self) -> None:
        self._last_used.value = time.time()

    def load_retry_due(self) -> bool:
        """The last failed load is over ``LOAD_RETRY_S`` old (an on-demand model may retry)."""
        return time.time() - float(self.info().get("failed_at") or 0.0) > LOAD_RETRY_S

    def in_flight_fenced(self) -> int:
        """``in_flight`` read under its lock: a full memory barrier after a ``load_state``
        write (the unload check must see a request admitted just before it)."""
        with self._in_flight.get_lock():
            return int(self._in_flight.value)

    # heartbeat (single writer: the engine thread) ---------------------------------------------
    def beat(self) -> None:
        self._heartbeat.value = time.time()

    def heartbeat_age(self) -> float:
        """Seconds since the engine thread last beat (inf before its first beat)."""
        last = self._heartbeat.value
        return float("inf") if last <= 0 else max(0.0, time.time() - last)

    # admission ------------------------------------------------------------------------------
    def try_admit(self, limit: int | None, count: int = 1) -> bool:
        """Count ``count`` more requests in flight (an HTTP request fanned out into several
        engine requests) unless that would pass ``limit`` (atomic across processes)."""
        with self._in_flight.get_lock():
            if limit is not None and self._in_flight.value + count > limit:
                return False
            self._in_flight.value += count
            return True

    def release(self, count: int = 1) -> None:
        with self._in_flight.get_lock():
            self._in_flight.value -= count

    @property
    def in_flight(self) -> int:
        return int(self._in_flight.value)

    # worker snapshot (single writer: the engine worker) ---------------------------------------
    def publish_stats(
        self, values: dict[str, float], executor: dict[str, float] | None = None
    ) -> None:
        """Overwrite the snapshot; fields not in ``values`` keep their previous value.
        ``executor``: the executor stage's counters (written only when they changed)."""
        if executor and executor != self._last_executor:
            self._last_executor = dict(executor)
            _write_blob(self._executor_seq, self._executor, executor, _EXECUTOR_BYTES)
        merged = [
            float(values.get(name, old))
            for name, old in zip(STATS_FIELDS, self._stats[1:], strict=True)
        ]
        seq = _even(int(self._stats[0]))
        self._stats[0] = seq + 1  # odd: a write is in progress
        self._stats[1:] = merged  # one copy: keeps the write window short
        self._stats[0] = seq + 2

    def clear_stats(self) -> None:
        """Zero the snapshot and the executor's counters (``worker_pid`` 0: no live worker).
        Only while no worker of this model is alive: its replacement is then the next (single)
        writer, and counts from zero."""
        self.publish_stats({**dict.fromkeys(STATS_FIELDS, 0.0), "updated_at": time.time()})
        self._last_executor = {}
        _write_blob(self._executor_seq, self._executor, {}, _EXECUTOR_BYTES)
        # the adapters outlive the worker (its successor restores them); its counters do not
        adapters = self.lora().get("adapters")
        self._last_lora = {}
        kept = {"adapters": adapters} if isinstance(adapters, list) else {}
        _write_blob(self._lora_seq, self._lora, kept, _LORA_BYTES)

    def stats(self) -> dict[str, float]:
        """A consistent snapshot (or, if the writer stalls mid-write, the last one seen here)."""
        snapshot = _seqlock_read(
            lambda: self._stats[0], lambda: list(self._stats[1:]), self._last_stats
        )
        self._last_stats = snapshot
        return dict(zip(STATS_FIELDS, snapshot, strict=True))

    def publish_info(self, info: dict[str, Any]) -> None:
        _write_blob(self._info_seq, self._info, info, _INFO_BYTES)

    def info(self) -> dict[str, Any]:
        return _read_blob(self._info_seq, self._info)

    def publish_lora(self, state: dict[str, Any]) -> None:
        """The worker's LoRA state (see the module docstring); written only when it changed
        (``updated_at`` aside)."""
        key = {k: v for k, v in state.items() if k != "updated_at"}
        if key == self._last_lora:
            return
        self._last_lora = key
        _write_blob(self._lora_seq, self._lora, state, _LORA_BYTES)

    def lora(self) -> dict[str, Any]:
        """The LoRA state the worker last published ({} before any did; only ``adapters``
        while no worker is alive)."""
        return _read_blob(self._lora_seq, self._lora)

    def executor_stats(self) -> dict[str, Any]:
        """The executor stage's counters as last published ({} if it has none)."""
        return _read_blob(self._executor_seq, self._executor)


def _write_blob(seq_value: Any, array: Any, obj: dict[str, Any], size: int) -> None:
    """Seqlock write of ``obj`` as JSON (single writer)."""
    data = json.dumps(obj, default=str).encode()[: size - 1]
    seq = _even(seq_value.value)
    seq_value.value = seq + 1
    array.value = data
    seq_value.value = seq + 2


def _read_blob(seq_value: Any, array: Any) -> dict[str, Any]:
    data = _seqlock_read(lambda: seq_value.value, lambda: array.value, b"")
    try:
        return json.loads(data) if data else {}
    except ValueError:  # truncated at the size limit
        return {}


def _even(seq: int) -> int:
    """The sequence a write starts from: a writer killed mid-write left it odd, and the next
    writer (its replacement) must not keep it odd, or every reader would fall back for good."""
    return seq + (seq & 1)


def _seqlock_read(
    sequence: Callable[[], float], read: Callable[[], _T], fallback: _T, patience_s: float = 0.05
) -> _T:
    """``read()`` with no write in progress before or during it.

    A writer descheduled mid-write (a loaded machine) is waited for, briefly; one that died
    mid-write never finishes, so after ``patience_s`` the caller gets ``fallback``.
    """
    deadline = None
    while True:
        before = sequence()
        if not int(before) % 2:
            value = read()
            if sequence() == before:
                return value
        now = time.monotonic()
        deadline = deadline if deadline is not None else now + patience_s
        if now > deadline:
            return fallback
        time.sleep(0.0002)
