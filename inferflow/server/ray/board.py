"""Where the engine replicas publish their state for the ingress: one small Ray actor.

A ``DeploymentHandle`` call reaches one replica, so ``/admin/stats``, ``/metrics`` and the
readiness count cannot ask "every replica". Instead each replica reports (stats, executor stats,
its Prometheus text) to the ``ReplicaBoard`` actor and the ingress reads the board. A replica
reports when its state changed (checked every ``REPORT_S``) and at least every
``IDLE_REPORT_S``; one not heard from for ``STALE_S`` (dead, replaced, scaled down) drops off.

The board also holds what every replica must agree on, whichever ingress replica changed it:

- the ingress replicas' own readiness (``/ready`` is 200 only when each of them can route);
- the LoRA adapters loaded or unloaded at run time, per model (``models:`` key): a replica that
  starts later (a replacement, a scale-up) applies them before it serves;
- the canary weights set through ``/admin/models/NAME/traffic`` (numbered: each ingress applies
  a change once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

REPORT_S = 0.5  # how often a replica looks at its state (and reports it when it changed)
IDLE_REPORT_S = 5.0  # an unchanged state is still reported this often (it is alive)
STALE_S = 15.0  # a replica not heard from for this long is gone
NAMESPACE = "inferflow"


class ReplicaBoard:
    """The latest report of each live replica (a Ray actor: ``ray.remote(ReplicaBoard)``)."""

    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._ingresses: dict[str, tuple[float, bool]] = {}
        # model key -> adapter name -> its folder (None: unloaded at run time)
        self._adapters: dict[str, dict[str, str | None]] = {}
        self._weights: tuple[int, dict[str, dict[str, float]]] = (0, {})  # (change no., name ->)

    def report(self, replica_id: str, report: dict[str, Any]) -> None:
        self._reports[replica_id] = (time.time(), report)

    def forget(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def read(self) -> dict[str, dict[str, Any]]:
        now = time.time()
        for rid in [r for r, (t, _) in self._reports.items() if now - t > STALE_S]:
            del self._reports[rid]
        return {rid: report for rid, (_, report) in sorted(self._reports.items())}

    def read_all(self) -> dict[str, Any]:
        """The replicas' reports, the ingress replicas' readiness and the shared settings."""
        now = time.time()
        for iid in [i for i, (t, _) in self._ingresses.items() if now - t > STALE_S]:
            del self._ingresses[iid]
        return {
            "replicas": self.read(),
            "ingresses": {i: ready for i, (_, ready) in self._ingresses.items()},
            "adapters": self._adapters,
            "weights": self._weights,
        }

    def report_ingress(self, ingress_id: str, ready: bool) -> None:
        self._ingresses[ingress_id] = (time.time(), ready)

    def forget_ingress(self, ingress_id: str) -> None:
        self._ingresses.pop(ingress_id, None)

    def set_adapter(self, model: str, name: str, path: str | None) -> None:
        """Adapter ``name`` of ``model`` loaded from ``path`` at run time (None: unloaded)."""
        self._adapters.setdefault(model, {})[name] = path

    def adapters(self, model: str) -> dict[str, str | None]:
        return dict(self._adapters.get(model, {}))

    def set_weights(self, name: str, weights: dict[str, float]) -> int:
        number, table = self._weights
        self._weights = (number + 1, {**table, name: dict(weights)})
        return number + 1


def board_actor(name: str) -> Any:
    """The named board, created on first use. Detached (a replica or ingress that creates it may
    die first): ``python -m inferflow server=ray`` kills it on exit; under ``serve deploy`` /
    KubeRay it stays with the cluster (one small actor, ``<app_name>-board``)."""
    import ray

    return (
        ray.remote(num_cpus=0)(ReplicaBoard)
        .options(
            name=name, namespace=NAMESPACE, get_if_exists=True, lifetime="detached", max_restarts=-1
        )
        .remote()
    )


def report_forever(
    name: str, replica_id: str, report: Callable[[], dict[str, Any]], stop: threading.Event
) -> None:
    """A replica's reporter thread: publish ``report()`` every ``REPORT_S`` until ``stop``."""
    import ray

    board, last, sent_at = None, None, float("-inf")
    while not stop.wait(REPORT_S):
        current = report()
        key = _changes(current)
        if key == last and time.monotonic() - sent_at < IDLE_REPORT_S:
            continue  # idle: nothing new to say yet
        try:
            board = board or board_actor(name)
            ray.get(board.report.remote(replica_id, current), timeout=5)
            last, sent_at = key, time.monotonic()
        except Exception as exc:  # the board restarts; the next report recreates the handle
            logger.debug("replica board: %s", exc)
            board = None
    try:
        if board is not None:
            board.forget.remote(replica_id)
    except Exception:
        pass


def _changes(report: dict[str, Any]) -> Any:
    """What makes a report worth sending: the state, not the time stamps that tick when idle."""
    stats = {k: v for k, v in report.get("stats", {}).items() if k != "updated_at"}
    return (
        report.get("ready"),
        tuple(sorted(stats.items())),
        report.get("metrics"),
        repr({k: v for k, v in (report.get("lora") or {}).items() if k != "updated_at"}),
    )


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus texts of several replicas as one exposition, each sample labelled
    ``replica="<id>"`` (families merged, so every metric's HELP/TYPE appears once)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Any] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, family)
            out = samples.setdefault(family.name, [])
            for s in family.samples:
                labels = {**s.labels, "replica": replica}
                body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
                out.append(f"{s.name}{{{body}}} {_number(s.value)}")
    lines = []
    for name, family in families.items():
        kind = family.type if family.type != "unknown" else "untyped"
        lines += [f"# HELP {name} {family.documentation}", f"# TYPE {name} {kind}", *samples[name]]
    return "\n".join(lines) + ("\n" if lines else "")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
