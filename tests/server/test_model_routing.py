"""Canary routing as a pure function: weights, pinning, stickiness, unknown models."""

from __future__ import annotations

import random

import pytest

from inferflow.embeddings.routing import (
    ModelRouter,
    ModelVersion,
    choose_version,
    split_model_id,
)

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
