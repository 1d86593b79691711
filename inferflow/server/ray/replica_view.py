"""What an ingress replica knows of the engine replicas, per model: read from the board.

Every ``READ_S`` a thread reads the board (``board.py``) and, for each LLM of the repository,
writes that model's ``SharedState`` in the ingress, which the single-machine routes read:

- **routable**: a replica that reports ready is probed once through the request path (a
  ``ReplicaProbe`` call through this ingress's own handle and router, ``EngineHub.probe``); only
  a replica that answered counts. A model is ready once as many replicas as it starts with
  (``num_replicas``, ``autoscaling.min_replicas``) are routable, and stays ready while one is;
  an on-demand model is ready while one is (scaled to zero: ``unloaded``).
- the summed engine stats of its routable replicas, the first one's engine description and its
  LoRA adapters (with this ingress's own runtime loads and unloads until every replica shows
  them);
- the canary weights set on any ingress replica;
- and this ingress's own readiness back to the board: ``/ready`` is 200 only when every ingress
  replica can route every eager model.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import TYPE_CHECKING, Any

from inferflow.config import LoadMode
from inferflow.server.ray.board import board_actor
from inferflow.server.ray.engine_client import PROBE_TIMEOUT_S, EngineHub
from inferflow.server.shared_state import STATS_FIELDS, LoadState

if TYPE_CHECKING:
    from inferflow.server.http.deployments import Deployment
    from inferflow.server.http.frontend import Frontend

logger = logging.getLogger(__name__)

READ_S = 1.0  # how often the ingress reads the replicas' reports
BOARD_TIMEOUT_S = 5.0

# every engine counter and gauge adds up across replicas, but the writer's pid and time stamp
_SUMMED = tuple(f for f in STATS_FIELDS if f not in ("worker_pid", "updated_at"))


class ReplicaView:
    """Keeps the ingress's per-model ``SharedState`` current from the board (a thread)."""

    def __init__(
        self,
        board_name: str,
        frontend: Frontend,
        hub: EngineHub,
        required: dict[str, int],
        ingress_id: str,
        num_ingresses: int,
    ) -> None:
        self.board_name, self.frontend, self.hub = board_name, frontend, hub
        self.required, self.ingress_id, self.num_ingresses = required, ingress_id, num_ingresses
        self.replicas: dict[str, dict[str, Any]] = {}  # every report (admin stats, metrics)
        self.routable: dict[str, set[str]] = {d.key: set() for d in frontend.deployments}
        self.seen: dict[str, bool] = {d.key: False for d in frontend.deployments}
        self.ingresses: dict[str, bool] = {}
        self.weights_applied = 0
        self._board: Any = None
        self._stop = threading.Event()
        for d in frontend.deployments:
            d.shared.set_load_state(
                LoadState.LOADING if d.load is LoadMode.eager else LoadState.UNLOADED
            )

    def start(self) -> None:
        threading.Thread(target=self._run, name="inferflow-replica-view", daemon=True).start()

    def stop(self) -> None:
        """Stop reading; this ingress leaves the board's readiness count."""
        self._stop.set()
        try:
            self.board().forget_ingress.remote(self.ingress_id)
        except Exception as exc:
            logger.debug("replica board: %s", exc)

    # --- what the ingress asks --------------------------------------------------------------------
    def routable_ids(self, key: str) -> list[str]:
        return sorted(self.routable.get(key, ()))

    def all_ingresses_ready(self) -> bool:
        return sum(bool(ready) for ready in self.ingresses.values()) >= self.num_ingresses

    def board(self) -> Any:
        if self._board is None:
            self._board = board_actor(self.board_name)
        return self._board

    async def record_adapter(self, key: str, name: str, path: str | None) -> None:
        import ray

        ref = self.board().set_adapter.remote(key, name, path)
        await asyncio.to_thread(ray.get, ref, timeout=BOARD_TIMEOUT_S)

    async def publish_weights(self, name: str, weights: dict[str, float]) -> None:
        import ray

        ref = self.board().set_weights.remote(name, weights)
        await asyncio.to_thread(ray.get, ref, timeout=BOARD_TIMEOUT_S)

    # --- the thread -------------------------------------------------------------------------------
    def _run(self) -> None:
        import ray

        while not self._stop.is_set():
            try:
                self.apply(ray.get(self.board().read_all.remote(), timeout=BOARD_TIMEOUT_S))
                mine = all(d.serving for d in self.frontend.deployments if d.load is LoadMode.eager)
                self.board().report_ingress.remote(self.ingress_id, mine)
            except Exception as exc:
                logger.debug("replica board: %s", exc)
                self._board = None
            self._stop.wait(READ_S)

    def apply(self, state: dict[str, Any]) -> None:
        self.replicas = state.get("replicas") or {}
        self.ingresses = state.get("ingresses") or {}
        by_model: dict[str, dict[str, dict[str, Any]]] = {}
        for rid, report in self.replicas.items():
            by_model.setdefault(str(report.get("model", "")), {})[rid] = report
        for deployment in self.frontend.deployments:
            self._apply_model(deployment, by_model.get(deployment.key, {}))
        self._apply_weights(state.get("weights") or (0, {}))

    def _apply_model(self, d: Deployment, reports: dict[str, dict[str, Any]]) -> None:
        key, shared = d.key, d.shared
        ready_ids = [rid for rid, r in reports.items() if r.get("ready")]
        known = self.routable.get(key, set()) & set(ready_ids)
        for rid in ready_ids:
            if rid not in known and self._probe(key, rid):
                known.add(rid)
        self.routable[key] = known
        live = [reports[rid] for rid in ready_ids if rid in known]
        if len(live) >= max(self.required.get(key, 1), 1):
            self.seen[key] = True
        shared.set_ready(self.seen[key] and bool(live))
        if live:
            shared.beat()
            shared.publish_info(live[0].get("info") or {})
            if shared.load_state != LoadState.LOADED:
                shared.count_load()
                shared.set_load_state(LoadState.LOADED)
            lora = self._lora_state(key, live)
            if lora:
                shared.publish_lora(lora)
        elif d.load is LoadMode.on_demand:
            self.seen[key] = False  # scaled to zero: its next replica is awaited again
            state, warming = shared.load_state, key in self.hub.warming
            if state == LoadState.LOADED:
                shared.count_unload()
            # LOADING without a warm-up call running: its replica went before it served (the
            # next waiting request wakes the deployment again)
            if (
                state == LoadState.LOADED
                or (state == LoadState.LOADING and not warming)
                or (state == LoadState.FAILED and shared.load_retry_due())
            ):
                shared.set_load_state(LoadState.LOADING if warming else LoadState.UNLOADED)
        totals = {k: float(sum(r["stats"].get(k, 0) for r in live)) for k in _SUMMED}
        # the executor counters of one replica (each replica's are in /admin/stats "replicas")
        shared.publish_stats(totals, executor=live[0].get("executor") if live else None)

    def _probe(self, key: str, replica_id: str) -> bool:
        loop = self.hub.loop
        if loop is None:
            return False
        future = asyncio.run_coroutine_threadsafe(self.hub.probe(key, replica_id), loop)
        try:
            return bool(future.result(PROBE_TIMEOUT_S + 2))
        except Exception:
            future.cancel()
            return False

    def _lora_state(self, key: str, live: list[dict[str, Any]]) -> dict[str, Any]:
        """The first live replica's LoRA state, with this ingress's runtime changes that not
        every live replica shows yet (a request right after a load finds the adapter)."""
        base = dict(live[0].get("lora") or {})
        if not base:
            return {}
        adapters = {str(a["name"]): str(a.get("path", "")) for a in base.get("adapters", ())}
        changes = self.hub.adapter_changes.get(key, {})
        for name, path in list(changes.items()):
            shown = all(
                (name in {a["name"] for a in (r.get("lora") or {}).get("adapters", ())})
                == (path is not None)
                for r in live
            )
            if shown:
                changes.pop(name, None)
            elif path is None:
                adapters.pop(name, None)
            else:
                adapters[name] = path
        base["adapters"] = [{"name": n, "path": p} for n, p in adapters.items()]
        return base

    def _apply_weights(self, weights: Any) -> None:
        number, table = weights
        if number <= self.weights_applied:
            return
        for name, shares in table.items():
            if name in self.frontend.router.by_name:
                try:
                    self.frontend.router.set_weights(name, shares)
                except (KeyError, ValueError) as exc:
                    logger.warning("canary weights of %s from the board: %s", name, exc)
        self.weights_applied = number
