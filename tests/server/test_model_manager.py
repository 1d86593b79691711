"""``ModelManager``'s decisions with fake worker processes: which model loads, which one is
unloaded for it (least recently used and idle only), crashes and load failures.

Real ``SharedState`` objects; the fake server records what would be launched and sent. The fake
pids do not exist, so every model's footprint is its estimate (100 MB each here).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from inferflow.config import LoadMode
from inferflow.server.messages import StopWorker, WorkerLost
from inferflow.server.process.model_manager import ManagedModel, ModelManager
from inferflow.server.shared_state import LoadState, SharedState

MB = 10**6
_pids = itertools.count(4_000_000)  # beyond pid_max: never a real process


class FakeProcess:
    def __init__(self) -> None:
        self.pid = next(_pids)
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        return self.exitcode is None


class FakeQueue(list):
    def put(self, item: Any) -> None:
        self.append(item)


@dataclass
class FakeServer:
    queues: dict[str, FakeQueue] = field(default_factory=dict)
    launched: list[str] = field(default_factory=list)
    sent: list[Any] = field(default_factory=list)

    @property
    def transport(self) -> FakeServer:
        return self

    def send(self, message: Any, consumer_id: int) -> None:
        self.sent.append(message)

    def launch(self, api: str) -> FakeProcess:
        self.launched.append(api)
        return FakeProcess()

    def queue(self, api: str) -> FakeQueue:
        return self.queues.setdefault(api, FakeQueue())

    def fresh_queue(self, api: str) -> FakeQueue:
        self.queues[api] = FakeQueue()
        return self.queues[api]

    def api_consumer_ids(self) -> list[int]:
        return [0]


def make(loads: dict[str, LoadMode], budget_mb: int | None) -> tuple[ModelManager, FakeServer]:
    server = FakeServer()
    models = [
        ManagedModel(key, f"{key}@1", load, api=key, shared=SharedState(), estimate_bytes=100 * MB)
        for key, load in loads.items()
    ]
    return ModelManager(server, models, None if budget_mb is None else budget_mb * MB), server


def model(manager: ModelManager, key: str) -> ManagedModel:
    return next(m for m in manager.models if m.key == key)


def become_ready(m: ManagedModel, manager: ModelManager | None = None) -> None:
    """What the worker does once it serves (``EngineAPI.mark_ready``); the requests that
    waited for it then finish."""
    m.shared.set_ready(True)
    m.shared.set_load_state(LoadState.LOADED)
    while m.shared.load_waiters:
        m.shared.add_load_waiter(-1)
    while m.shared.in_flight:
        m.shared.release()


def request(manager: ModelManager, key: str, at: float) -> None:
    """A request for ``key`` arrives (its ``last_used`` is ``at``), waits for the load and
    finishes once the model serves (``finish``)."""
    m = model(manager, key)
    m.shared._last_used.value = at
    assert m.shared.try_admit(None)
    m.shared.add_load_waiter(1)  # what wait_until_serving does
    manager.poll()


def finish(manager: ModelManager, key: str) -> None:
    """A request on ``key`` ends (it did not wait for a load, or its wait is over)."""
    shared = model(manager, key).shared
    if shared.load_waiters:
        shared.add_load_waiter(-1)
    shared.release()


def exit_worker(manager: ModelManager, key: str, code: int = 0) -> str | None:
    m = model(manager, key)
    assert m.process is not None
    m.process.exitcode = code
    outcome = manager.on_death(m.process)
    manager.poll()  # what the supervisor does next, in the same pass
    return outcome


ON_DEMAND = LoadMode.on_demand


def test_eager_models_start_and_settle_when_ready() -> None:
    manager, server = make({"e": LoadMode.eager, "o": ON_DEMAND}, None)
    manager.start()
    assert server.launched == ["e"] and not manager.settled()
    become_ready(model(manager, "e"))
    assert manager.settled()
    manager.poll()  # nobody asked for "o"
    assert server.launched == ["e"]


def test_the_least_recently_used_idle_model_makes_room_and_the_load_waits_for_its_exit() -> None:
    manager, server = make({"a": ON_DEMAND, "b": ON_DEMAND, "c": ON_DEMAND}, budget_mb=250)
    request(manager, "a", at=1.0)
    request(manager, "b", at=2.0)
    become_ready(model(manager, "a"))
    become_ready(model(manager, "b"))
    assert server.launched == ["a", "b"]  # 200 MB fit
    request(manager, "c", at=3.0)  # 300 MB would not: "a" is the least recently used
    assert server.launched == ["a", "b"] and manager.pending
    assert model(manager, "a").shared.load_state == LoadState.UNLOADING
    assert isinstance(server.queue("a")[-1], StopWorker)
    exit_worker(manager, "a")  # its exit starts "c"
    assert server.launched == ["a", "b", "c"]
    assert model(manager, "a").shared.load_state == LoadState.UNLOADED


def test_a_busy_model_is_never_unloaded() -> None:
    manager, server = make({"a": ON_DEMAND, "b": ON_DEMAND}, budget_mb=150)
    request(manager, "a", at=1.0)
    become_ready(model(manager, "a"))
    assert model(manager, "a").shared.try_admit(None)  # a request in flight on "a"
    request(manager, "b", at=2.0)
    assert server.launched == ["a"] and manager.pending and not server.queue("a")
    finish(manager, "a")
    manager.poll()  # now idle: unloaded for "b"
    assert isinstance(server.queue("a")[-1], StopWorker)
    exit_worker(manager, "a")
    assert server.launched == ["a", "b"]


def test_a_request_admitted_during_the_unload_check_keeps_the_model() -> None:
    manager, _ = make({"a": ON_DEMAND}, budget_mb=None)
    request(manager, "a", at=1.0)
    m = model(manager, "a")
    become_ready(m)
    m.shared.try_admit(None)  # admitted just before the unload decision
    assert not manager._unload(m)
    assert m.shared.load_state == LoadState.LOADED


def test_a_crash_fails_that_models_requests_and_it_reloads_on_demand() -> None:
    manager, server = make({"e": LoadMode.eager, "o": ON_DEMAND}, None)
    manager.start()
    request(manager, "o", at=1.0)
    for key in ("e", "o"):
        become_ready(model(manager, key))
    old_queue = server.queue("o")
    assert model(manager, "o").shared.try_admit(None)  # running when the worker dies
    model(manager, "o").shared.publish_stats({"running": 1, "waiting": 2})  # its last snapshot
    assert exit_worker(manager, "o", code=-9) is None
    stats = model(manager, "o").shared.stats()
    assert (stats["running"], stats["waiting"]) == (0, 0)  # not the dead worker's figures
    (notice,) = server.sent
    assert isinstance(notice, WorkerLost) and notice.deployment == "o"
    assert notice.request_queue is server.queue("o") and notice.request_queue is not old_queue
    assert model(manager, "o").shared.load_state == LoadState.UNLOADED
    manager.poll()  # its failing request (still counted) does not reload it
    assert server.launched == ["e", "o"]
    finish(manager, "o")
    request(manager, "o", at=2.0)  # the next request loads it again
    assert server.launched == ["e", "o", "o"]
    exit_worker(manager, "e", code=-9)  # an eager model restarts at once
    assert server.launched == ["e", "o", "o", "e"]


def test_load_failures_are_reported_and_fatal_only_when_nothing_can_serve() -> None:
    manager, _ = make({"x": LoadMode.eager, "y": LoadMode.eager}, None)
    manager.start()
    model(manager, "x").shared.publish_info({"load_error": "ValueError: bad weights"})
    assert exit_worker(manager, "x", code=0) is None  # "y" is still loading
    assert model(manager, "x").shared.load_state == LoadState.FAILED
    assert exit_worker(manager, "y", code=0) == "fatal"


def test_a_model_that_can_never_fit_fails_at_once_and_nothing_is_unloaded_for_it() -> None:
    manager, server = make({"e": LoadMode.eager, "o": ON_DEMAND, "big": ON_DEMAND}, 250)
    model(manager, "big").estimate_bytes = 200 * MB
    manager.start()
    become_ready(model(manager, "e"))
    request(manager, "o", at=1.0)
    become_ready(model(manager, "o"))
    request(manager, "big", at=2.0)  # 100 (eager) + 200 > 250 whatever is unloaded
    big = model(manager, "big")
    assert big.shared.load_state == LoadState.FAILED
    assert "model_memory_budget" in big.shared.info()["load_error"]
    assert not server.queue("o") and not manager.pending  # "o" stays loaded


def test_an_unload_that_hangs_is_killed_and_a_failed_launch_is_reported() -> None:
    manager, server = make({"a": ON_DEMAND, "b": ON_DEMAND}, budget_mb=150)
    request(manager, "a", at=1.0)
    become_ready(model(manager, "a"))
    request(manager, "b", at=2.0)
    a = model(manager, "a")
    assert a.stopping
    killed = []
    a.process.kill = lambda: killed.append(True)  # type: ignore[union-attr]
    a.stop_deadline = 0.0  # past its deadline
    manager.poll()
    assert killed == [True]

    def refuse(api: str) -> FakeProcess:
        raise OSError("cannot allocate memory")

    server.launch = refuse  # type: ignore[method-assign]
    exit_worker(manager, "a", code=-9)  # its exit starts "b": the spawn fails
    b = model(manager, "b")
    assert b.shared.load_state == LoadState.FAILED
    assert "cannot allocate memory" in b.shared.info()["load_error"]


def test_an_on_demand_load_past_the_load_timeout_is_killed_and_fails() -> None:
    manager, _ = make({"slow": ON_DEMAND}, budget_mb=None)
    request(manager, "slow", at=1.0)
    slow = model(manager, "slow")
    assert manager.pending  # polled again while it loads
    killed = []
    slow.process.kill = lambda: killed.append(True)  # type: ignore[union-attr]
    slow.load_deadline = 0.0
    manager.poll()
    assert killed == [True]
    exit_worker(manager, "slow", code=-9)
    assert slow.shared.load_state == LoadState.FAILED
    assert "did not load within" in slow.shared.info()["load_error"]


def test_a_worker_killed_mid_write_does_not_leave_its_replacements_snapshots_unreadable() -> None:
    shared = SharedState()
    shared.publish_stats({"running": 3})
    assert shared.stats()["running"] == 3
    shared._stats[0] += 1  # SIGKILL between "a write is in progress" and "done"
    assert shared.stats()["running"] == 3  # readers fall back to the last snapshot they saw
    shared.publish_stats({"running": 0})  # the replacement worker's first snapshot
    assert shared.stats()["running"] == 0
    shared.publish_info({"engine": "a"})
    shared._info_seq.value += 1  # the same for the info blob
    shared.publish_info({"engine": "b"})
    assert shared.info() == {"engine": "b"}
