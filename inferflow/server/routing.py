"""Which served model version answers a request: pure functions, no I/O.

A request's ``model`` is ``name`` or ``name@version``. ``name@version`` pins that version; a
plain ``name`` draws one of the name's versions with probability proportional to its
``weight`` (a canary split such as v1 0.8 / v2 0.2). With a ``user`` the draw is a hash of
(name, user), so one user keeps seeing one version (sticky); otherwise it comes from the
injected ``random.Random`` (seed it for reproducible tests).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelVersion:
    """One served version of a model; ``weight`` is its share of unpinned traffic."""

    name: str
    version: str
    weight: float = 1.0

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.version}"


def split_model_id(model: str) -> tuple[str, str | None]:
    """``"name@v2"`` -> ``("name", "v2")``; ``"name"`` -> ``("name", None)``."""
    name, sep, version = model.rpartition("@")
    return (name, version) if sep and name and version else (model, None)


def sticky_draw(name: str, user: str) -> float:
    """A uniform number in [0, 1) fixed by (name, user)."""
    digest = hashlib.sha256(f"{name}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def choose_version(
    versions: Sequence[ModelVersion], rng: random.Random, user: str | None = None
) -> ModelVersion:
    """Pick one of ``versions`` (all of one name) with probability ``weight / sum(weights)``.

    Zero-weight versions are reachable only by pinning; if every weight is zero the first
    version serves. ``versions`` must not be empty.
    """
    if not versions:
        raise ValueError("choose_version: no versions to choose from")
    total = sum(v.weight for v in versions)
    if total <= 0:
        return versions[0]
    u = sticky_draw(versions[0].name, user) if user else rng.random()
    point = u * total
    for version in versions:
        point -= version.weight
        if point < 0 and version.weight > 0:
            return version
    return [v for v in versions if v.weight > 0][-1]  # float round-off at the top end


class ModelRouter:
    """``model`` field -> a served version, or ``None`` when no such model is served."""

    def __init__(self, versions: Sequence[ModelVersion], rng: random.Random | None = None) -> None:
        self.by_name: dict[str, list[ModelVersion]] = {}
        for v in versions:
            self.by_name.setdefault(v.name, []).append(v)
        self.rng = rng or random.Random()

    def route(self, model: str, user: str | None = None) -> ModelVersion | None:
        if model in self.by_name:
            return choose_version(self.by_name[model], self.rng, user)
        name, version = split_model_id(model)
        return next((v for v in self.by_name.get(name, []) if v.version == version), None)

    def model_ids(self) -> list[str]:
        """Every id a client may send: each name, then each ``name@version``."""
        return [*self.by_name, *(v.model_id for group in self.by_name.values() for v in group)]
