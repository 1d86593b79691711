"""The LLM versions an API process routes to (the model repository, API side).

A ``Deployment`` is one served LLM version: its request stages (``RequestPipeline``: its own
tokenizer and limits), the request queue of its engine worker and that worker's
``SharedState``. ``DeploymentRouter`` turns a request's ``model`` into a deployment:
``name@version`` pins one; a plain ``name`` draws one of the name's versions by their current
weights (shared memory, so a change through ``POST /admin/models/{name}/traffic`` reaches every
API process at once), sticky per user when a key is given (``server.routing``'s draw).

A LoRA adapter (``lora:`` of a version) is served under its own name: ``route_adapter`` finds
the version whose engine worker serves it (what the worker published in ``SharedState.lora``,
so every API process agrees, runtime loads included); ``/v1/models`` lists it as a card whose
``parent`` is that version's name and ``root`` the adapter's folder, as vLLM does.

Only versions that can take a request are drawn (``Deployment.routable``): the weights are
renormalised over them (``DeploymentRouter.effective_weights``), so a failed or restarting
version sends its share to the others instead of failing it; a pin still reaches it (503
``model_load_failed`` with ``Retry-After``). When no routable version has a weight, the
configured weights apply as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from inferflow.config import LoadMode
from inferflow.server.http.errors import OpenAIError, field_name
from inferflow.server.http.pipeline import RequestPipeline
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.lora import LoraServing, published_adapters
from inferflow.server.process_utils import process_rss
from inferflow.server.routing import ModelVersion, choose_version, split_model_id
from inferflow.server.shared_state import LOAD_RETRY_S, LoadState, SharedState


@dataclass
class Deployment:
    """One LLM version behind the OpenAI routes."""

    key: str  # its entry under ``models:`` ("" for a lone top-level model); WorkerLost names it
    name: str
    version: str
    load: LoadMode
    pipeline: RequestPipeline
    shared: SharedState
    responses: ResponsePipeline
    model_path: str = ""
    request_queue: Any = None  # its engine worker's request queue (a Manager proxy)
    slots_hint: int = 0  # its engine's slots before it ever loaded (then its stats say)
    lora: LoraServing | None = None  # its ``lora`` settings (None: it serves no adapters)

    @property
    def model_id(self) -> str:
        return f"{self.name}@{self.version}"

    def adapters(self) -> dict[str, str]:
        """The LoRA adapters it serves now, name -> path (its worker's published list; the
        configured one until the worker published)."""
        return published_adapters(self.shared, self.lora)

    @property
    def serving(self) -> bool:
        """Its worker is loaded and consuming requests."""
        return self.shared.ready and self.shared.load_state == LoadState.LOADED

    def status(self) -> str:
        """``ready``, ``loading``, ``unloaded``, ``unloading``, ``failed`` or ``not_ready``
        (loaded but not serving: its worker just died, or on Ray, no replica is up)."""
        state = self.shared.load_state
        if state == LoadState.LOADED:
            return "ready" if self.shared.ready else "not_ready"
        return LoadState.NAMES[state]

    @property
    def routable(self) -> bool:
        """It may take unpinned requests: it serves, or it is on demand and has not failed (it
        loads for the request). A failed version, or an eager one loading or restarting, does
        not (a pin still reaches it)."""
        if self.shared.load_state == LoadState.FAILED:
            return False
        return self.serving or self.load is LoadMode.on_demand

    def rss_bytes(self) -> int | None:
        """Its worker's resident memory now (None when it is not loaded)."""
        if not self.serving:
            return None
        return process_rss(int(self.shared.stats()["worker_pid"])) or None

    def load_error(self) -> str | None:
        """Why it failed to load; None when it did not, or when it is on demand and failed
        more than ``LOAD_RETRY_S`` ago (the next request tries again)."""
        if self.shared.load_state != LoadState.FAILED:
            return None
        if self.load is LoadMode.on_demand and self.shared.load_retry_due():
            return None
        return str(self.shared.info().get("load_error") or "the engine worker exited during load")

    def describe(self) -> dict[str, Any]:
        """This version for ``/ready``, ``/version`` and ``/admin/stats``."""
        out: dict[str, Any] = {
            "id": self.model_id,
            "name": self.name,
            "version": self.version,
            "load": self.load.value,
            "status": self.status(),
            "weight": self.shared.weight,
            "routable": self.routable,
            "rss_bytes": self.rss_bytes(),
            "memory_bytes": self.shared.memory_bytes or None,  # what the budget counts
        }
        if self.shared.load_state == LoadState.FAILED:  # (also once a request may retry it)
            out["error"] = str(self.shared.info().get("load_error") or "the worker exited")
        return out


LOAD_POLL_S = 0.05  # while a request waits for its model to load (only then: no idle polling)
MAX_WEIGHT = 1e6  # weights are relative shares; bounded so that their sum stays finite
WAKE_EVERY_S = 1.0  # ... and how often it reminds the supervisor while the load has not begun


class LoadRequests:
    """How an API process asks the main process to load a model: the request waiting for it
    is counted in its ``in_flight``; one byte on the supervisor's wake-up pipe (inherited when
    the API process forks) makes the supervisor look now."""

    def __init__(self, wake_fd: int | None = None) -> None:
        self.wake_fd = wake_fd

    def wake(self) -> None:
        if self.wake_fd is not None:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(self.wake_fd, b"L")


class DeploymentRouter:
    """``model`` (+ optional sticky key) -> a ``Deployment``, or None for an unknown model."""

    def __init__(self, deployments: list[Deployment], rng: random.Random | None = None) -> None:
        self.deployments = list(deployments)
        self.by_name: dict[str, list[Deployment]] = {}
        for d in self.deployments:
            self.by_name.setdefault(d.name, []).append(d)
        self.rng = rng or random.Random()

    def route(self, model: str, user: str | None = None) -> Deployment | None:
        versions = self.by_name.get(model)
        if versions is not None:
            if len(versions) == 1:
                return versions[0]
            shares = self.effective_weights(model)
            weighted = [ModelVersion(d.name, d.version, shares[d.version]) for d in versions]
            chosen = choose_version(weighted, self.rng, user)
            return next(d for d in versions if d.version == chosen.version)
        name, version = split_model_id(model)
        return next((d for d in self.by_name.get(name, []) if d.version == version), None)

    def route_adapter(self, model: str) -> Deployment | None:
        """The version that serves LoRA adapter ``model`` (None: no version serves one of that
        name). A served model name always wins over an adapter (``route`` is asked first)."""
        return next((d for d in self.deployments if model in d.adapters()), None)

    def adapter_cards(self, created: int) -> list[dict[str, Any]]:
        """vLLM's ``/v1/models`` card of every adapter: ``id`` its name, ``parent`` its base
        model (the name, ``name@version`` when the name has several versions), ``root`` its
        folder."""
        cards = []
        for d in self.deployments:
            parent = d.name if len(self.by_name[d.name]) == 1 else d.model_id
            for name, path in d.adapters().items():
                cards.append({
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "inferflow",
                    "root": path,
                    "parent": parent,
                    "max_model_len": d.pipeline.max_model_len,
                })
        return cards

    def effective_weights(self, name: str) -> dict[str, float]:
        """Each version of ``name`` -> its share (0..1) of unpinned requests now: the weights
        renormalised over the routable versions; when none of those has a weight, over every
        version with one (requests may then meet a 503); with no weight at all, the first."""
        versions = self.by_name[name]
        weighted = [d for d in versions if d.shared.weight > 0]
        pool = {d.version: d.shared.weight for d in weighted if d.routable} or {
            d.version: d.shared.weight for d in weighted
        }
        total = sum(pool.values())
        if total <= 0:
            return {d.version: float(i == 0) for i, d in enumerate(versions)}
        return {d.version: pool.get(d.version, 0.0) / total for d in versions}

    def effective_weight(self, deployment: Deployment) -> float:
        return self.effective_weights(deployment.name)[deployment.version]

    def cards(self, created: int) -> list[dict[str, Any]]:
        """``/v1/models`` cards: each name (all its versions), then ``name@version`` for names
        with several versions."""
        cards = []
        for name, versions in self.by_name.items():
            entries = [(name, versions)] + (
                [(d.model_id, [d]) for d in versions] if len(versions) > 1 else []
            )
            for model_id, served in entries:
                cards.append({
                    "id": model_id,
                    "object": "model",
                    "created": created,
                    "owned_by": "inferflow",
                    "max_model_len": served[0].pipeline.max_model_len,
                    "versions": [
                        {
                            "version": d.version,
                            "weight": d.shared.weight,
                            "effective_weight": self.effective_weight(d),
                            "routable": d.routable,
                            "status": d.status(),
                        }
                        for d in served
                    ],
                })
        return cards

    def model_ids(self) -> list[str]:
        """Every id a client may send: each name, then each ``name@version``."""
        return [*self.by_name, *(d.model_id for d in self.deployments)]

    def set_weights(self, name: str, weights: dict[str, float]) -> list[Deployment]:
        """Set the split of ``name``'s versions (versions not named get 0); ``ValueError``
        naming what is wrong. Returns the versions."""
        versions = self.by_name.get(name)
        if versions is None:
            raise KeyError(name)
        known = {d.version for d in versions}
        unknown = [v for v in weights if v not in known]
        if unknown:
            raise ValueError(
                f"unknown version(s) {_some(unknown)} of `{name}`; its versions: "
                f"{_some(sorted(known))}"
            )
        # -0.0 passes ``0 <= w`` but is a sign error: refused like any negative weight
        in_range = all(
            0 <= w <= MAX_WEIGHT and math.copysign(1.0, w) > 0 for w in weights.values()
        )
        if not in_range or not any(w > 0 for w in weights.values()):
            raise ValueError(
                f"weights: every weight must be a number in [0, {MAX_WEIGHT:g}] (not -0), "
                "one of them > 0"
            )
        for d in versions:
            d.shared.set_weight(float(weights.get(d.version, 0.0)))
        return versions


def _some(names: list[str], shown: int = 3) -> str:
    """The first ``shown`` of ``names``, each quoted short and safe, and how many more."""
    head = ", ".join(field_name(n) for n in names[:shown])
    return head + (f" and {len(names) - shown} more" if len(names) > shown else "")


def load_failed(deployment: Deployment) -> OpenAIError | None:
    """The 503 for a model that failed to load (None when it did not)."""
    error = deployment.load_error()
    if error is None:
        return None
    # an on-demand model is tried again LOAD_RETRY_S after its failure; an eager one is not
    # before a restart, and LOAD_RETRY_S is as good a pace as any to look again
    retry = LOAD_RETRY_S
    if deployment.load is LoadMode.on_demand:
        retry -= time.time() - float(deployment.shared.info().get("failed_at") or time.time())
    return OpenAIError.of(
        503, f"The model `{deployment.model_id}` failed to load: {error}",
        code="model_load_failed", retry_after_s=max(1.0, retry),
    )


async def wait_until_serving(
    deployment: Deployment,
    timeout_s: float,
    is_draining: Callable[[], bool],
    load_requests: LoadRequests,
) -> str:
    """Wait (counted in ``load_waiters``: what makes the main process load it) until
    ``deployment`` serves; returns ``"loaded"``. A 503 when it fails to load
    (``model_load_failed``), the server drains (``shutting_down``) or ``timeout_s`` passes
    (``model_load_timeout``)."""
    deadline = time.time() + timeout_s
    woke = 0.0
    deployment.shared.add_load_waiter(1)
    try:
        while not deployment.serving:
            if is_draining():
                raise OpenAIError.of(503, "The server is shutting down.", code="shutting_down")
            if (failed := load_failed(deployment)) is not None:
                raise failed
            now = time.time()
            if now > deadline:
                raise OpenAIError.of(
                    503,
                    f"The model `{deployment.model_id}` did not load within {timeout_s:g} s "
                    "(server.model_load_timeout_s).",
                    code="model_load_timeout",
                    retry_after_s=5,
                )
            if deployment.shared.load_state != LoadState.LOADING and now - woke >= WAKE_EVERY_S:
                load_requests.wake()  # not loading yet (unloading, or to be retried): ask now
                woke = now
            await asyncio.sleep(LOAD_POLL_S)
    finally:
        deployment.shared.add_load_waiter(-1)
    return "loaded"


_REPOSITORY_METRICS = (
    # (name, type, help, value of a deployment)
    ("inferflow:model_loaded", "gauge", "1 while the model version serves requests.",
     lambda r, d: 1 if d.serving else 0),
    ("inferflow:model_memory_bytes", "gauge",
     "What server.model_memory_budget counts the model version for (bytes).",
     lambda r, d: d.shared.memory_bytes),
    ("inferflow:model_weight", "gauge", "The version's configured weight (canary split).",
     lambda r, d: d.shared.weight),
    ("inferflow:model_effective_weight", "gauge",
     "The version's share of unpinned requests now: its weight renormalised over the versions "
     "that can serve (0 while it cannot).", lambda r, d: r.effective_weight(d)),
    ("inferflow:model_routable", "gauge",
     "1 while the version may take unpinned requests (ready, or on demand and not failed).",
     lambda r, d: 1 if d.routable else 0),
    ("inferflow:model_load_waiters", "gauge", "Requests waiting for the model to load.",
     lambda r, d: d.shared.load_waiters),
    ("inferflow:model_loads_total", "counter", "Engine worker starts of the model version.",
     lambda r, d: d.shared.loads),
    ("inferflow:model_unloads_total", "counter",
     "Unloads of the model version to make room within the memory budget.",
     lambda r, d: d.shared.unloads),
)


def repository_metrics(router: DeploymentRouter) -> bytes:
    """Prometheus text of the repository's state, read from shared memory when scraped (so
    every API process answers the same)."""
    lines = []
    for name, kind, text, value in _REPOSITORY_METRICS:
        lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        for d in router.deployments:
            labels = f'model_name="{_label(d.name)}",version="{_label(d.version)}"'
            lines.append(f"{name}{{{labels}}} {float(value(router, d))}")
    return ("\n".join(lines) + "\n").encode()


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
