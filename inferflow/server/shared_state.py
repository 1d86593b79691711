"""State every process of one server reads without a Manager round-trip.

Created in the main process before the engine worker is spawned (the object travels inside the
pickled LitAPI, which multiprocessing allows for synchronized values at spawn time) and before
the API processes are forked (they inherit the shared memory).

- ``ready``: the worker loaded its engine and ran a warm-up step; cleared when it dies.
- ``draining``: the supervisor received SIGTERM/SIGINT; new requests get 503.
- ``in_flight``: admitted requests across all API processes (the waiting-queue bound).
- ``stats``: a snapshot the worker writes after every engine step (running, waiting, slots,
  KV blocks, counters) — what ``GET /admin/stats`` shows.
- ``info``: a JSON blob the worker writes once (engine and runtime versions, ``max_model_len``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
from typing import Any

STATS_FIELDS = (
    "running",  # requests in the running batch
    "waiting",  # requests queued inside the engine
    "free_slots",
    "total_slots",
    "kv_blocks_free",
    "kv_blocks_total",
    "num_steps",
    "finished_requests",
    "aborted_requests",  # cancelled: client disconnected or frontend gave up
    "timed_out_requests",
    "worker_pid",
    "updated_at",  # time.time() of the snapshot
)
_INFO_BYTES = 16384


class SharedState:
    """Lock-protected shared values; see the module docstring for what each one means."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self._ready = ctx.Value("b", 0)
        self._draining = ctx.Value("b", 0)
        self._in_flight = ctx.Value("i", 0)
        self._stats = ctx.Array("d", len(STATS_FIELDS))
        self._info = ctx.Array("c", _INFO_BYTES)

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

    # admission ------------------------------------------------------------------------------
    def try_admit(self, limit: int | None) -> bool:
        """Count one more request in flight unless ``limit`` are already (atomic across processes)."""
        with self._in_flight.get_lock():
            if limit is not None and self._in_flight.value >= limit:
                return False
            self._in_flight.value += 1
            return True

    def release(self) -> None:
        with self._in_flight.get_lock():
            self._in_flight.value -= 1

    @property
    def in_flight(self) -> int:
        return int(self._in_flight.value)

    # worker snapshot ------------------------------------------------------------------------
    def publish_stats(self, values: dict[str, float]) -> None:
        """Overwrite the snapshot; fields not in ``values`` keep their previous value."""
        with self._stats.get_lock():
            for i, name in enumerate(STATS_FIELDS):
                if name in values:
                    self._stats[i] = float(values[name])

    def stats(self) -> dict[str, float]:
        with self._stats.get_lock():
            snapshot = list(self._stats)
        return dict(zip(STATS_FIELDS, snapshot, strict=True))

    def publish_info(self, info: dict[str, Any]) -> None:
        data = json.dumps(info, default=str).encode()[: _INFO_BYTES - 1]
        with self._info.get_lock():
            self._info.value = data

    def info(self) -> dict[str, Any]:
        with self._info.get_lock():
            data = self._info.value
        return json.loads(data) if data else {}
