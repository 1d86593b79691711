"""Canary routing as a pure function: weights, pinning, stickiness, unknown models; the LLM
router's renormalisation over the versions that can serve (real ``SharedState``s)."""

from __future__ import annotations

import random

import pytest

from inferflow.config import LoadMode
from inferflow.server.http.deployments import Deployment, DeploymentRouter
from inferflow.server.routing import (
    ModelRouter,
    ModelVersion,
    choose_version,
    split_model_id,
)
from inferflow.server.shared_state import LoadState, SharedState

V1 = ModelVersion("enc", "1", 0.8)
V2 = ModelVersion("enc", "2", 0.2)


def test_observed_share_matches_weight_over_10000_seeded_draws() -> None:
    rng = random.Random(1234)
    draws = [choose_version([V1, V2], rng).version for _ in range(10_000)]
    share_v2 = draws.count("2") / len(draws)
    # binomial sd = sqrt(0.2 * 0.8 / 10000) = 0.004; 0.015 is ~3.75 sd
    assert share_v2 == pytest.approx(0.2, abs=0.015)


def test_same_seed_same_sequence_and_three_way_split() -> None:
    versions = [ModelVersion("m", "a", 1), ModelVersion("m", "b", 2), ModelVersion("m", "c", 1)]
    first = [choose_version(versions, random.Random(7)).version for _ in range(3)]
    assert first == [choose_version(versions, random.Random(7)).version for _ in range(3)]
    rng = random.Random(0)
    draws = [choose_version(versions, rng).version for _ in range(8000)]
    assert draws.count("b") / 8000 == pytest.approx(0.5, abs=0.03)


def test_zero_weight_only_by_pinning() -> None:
    dark = ModelVersion("enc", "3", 0.0)
    rng = random.Random(0)
    assert {choose_version([V1, dark], rng).version for _ in range(500)} == {"1"}
    router = ModelRouter([V1, dark], random.Random(0))
    assert router.route("enc@3") == dark


def test_sticky_by_user() -> None:
    router = ModelRouter([V1, V2], random.Random(0))
    for user in ("alice", "bob", "carol"):
        first = router.route("enc", user)
        assert all(router.route("enc", user) == first for _ in range(20))
    # different users still split by weight
    chosen = [router.route("enc", f"user-{i}") for i in range(4000)]
    assert sum(v == V2 for v in chosen) / 4000 == pytest.approx(0.2, abs=0.03)


def test_pinning_unknown_and_ids() -> None:
    router = ModelRouter([V1, V2, ModelVersion("other", "7")], random.Random(0))
    assert router.route("enc@2") == V2
    assert router.route("enc@9") is None
    assert router.route("nope") is None
    assert router.model_ids() == ["enc", "other", "enc@1", "enc@2", "other@7"]
    assert split_model_id("a@b@c") == ("a@b", "c")
    assert split_model_id("plain") == ("plain", None)
    assert split_model_id("@x") == ("@x", None)


def _deployment(version: str, weight: float, state: int, load: str = "eager") -> Deployment:
    shared = SharedState(weight)
    shared.set_load_state(state)
    shared.set_ready(state == LoadState.LOADED)
    return Deployment(f"m{version}", "m", version, LoadMode(load), None, shared, None)  # type: ignore[arg-type]


def test_unpinned_requests_go_only_to_versions_that_can_serve() -> None:
    v1 = _deployment("1", 1.0, LoadState.LOADED)
    v2 = _deployment("2", 1.0, LoadState.LOADED)
    router = DeploymentRouter([v1, v2], random.Random(0))
    assert router.effective_weights("m") == {"1": 0.5, "2": 0.5}
    v2.shared.set_load_state(LoadState.FAILED)  # failed to load: its share goes to v1
    assert router.effective_weights("m") == {"1": 1.0, "2": 0.0}
    assert {router.route("m").version for _ in range(200)} == {"1"}  # type: ignore[union-attr]
    assert router.route("m@2") is v2  # a pin still reaches it (and meets its 503)
    v1.shared.set_load_state(LoadState.LOADING)  # eager v1 restarting, v2 on demand, unloaded
    v2.load = LoadMode.on_demand
    v2.shared.set_load_state(LoadState.UNLOADED)
    assert router.effective_weights("m") == {"1": 0.0, "2": 1.0}
    v1.shared.set_load_state(LoadState.LOADED)
    v1.shared.set_weight(0.0)  # promoted v2 ... which then failed: the operator's split stands
    v2.shared.set_load_state(LoadState.FAILED)
    assert router.effective_weights("m") == {"1": 0.0, "2": 1.0}


def test_traffic_weights_refuse_minus_zero_and_bound_unknown_names() -> None:
    router = DeploymentRouter([_deployment("1", 1.0, LoadState.LOADED),
                               _deployment("2", 1.0, LoadState.LOADED)])
    with pytest.raises(ValueError, match="not -0"):
        router.set_weights("m", {"1": 1.0, "2": -0.0})
    with pytest.raises(ValueError) as err:
        router.set_weights("m", {"\ud800" + "x" * 1000: 1.0, **{str(i): 1.0 for i in range(9, 99)}})
    message = str(err.value)
    assert len(message) < 400 and "and 88 more" in message and "\\ud800" in message
    message.encode("utf-8")  # the lone surrogate is escaped


def test_a_dead_workers_stats_are_cleared() -> None:
    shared = SharedState()
    shared.publish_stats({"worker_pid": 4242, "finished_requests": 7, "total_slots": 16},
                         executor={"kv_resident": 1.0})
    shared.clear_stats()
    stats = shared.stats()
    assert stats["worker_pid"] == stats["finished_requests"] == stats["total_slots"] == 0
    assert shared.executor_stats() == {}
