r"""The model repository in the main process: one engine worker per LLM version.

The supervisor calls ``poll()`` each time it wakes (a child died, a signal, the watchdog's
second, or an API process wrote a byte to its wake-up pipe because a request waits for an
unloaded model), and ``on_death`` for each worker that exited. Nothing here polls on its own:
only while a load or an unload is under way does the supervisor come back every 0.25 s; an idle
server uses no CPU. A model is *wanted* while requests wait for its load
(``SharedState.load_waiters``); requests a crash failed never wait, so they do not reload it.

Per model (``ManagedModel``), ``SharedState.load_state`` moves::

    unloaded --load--> loading --worker ready--> loaded --unload--> unloading --exit--> unloaded
                          \--exit before ready--> failed          (crash) --> restart / unloaded

Eager models load at start and are restarted after a crash; on-demand models load when a
request waits for them (a load taking longer than ``server.model_load_timeout_s`` is killed and
fails), are unloaded (least recently used first, idle ones only) when loading another would
exceed ``server.model_memory_budget``, and after a crash reload for the next request. A failed
on-demand model is tried again by a request ``LOAD_RETRY_S`` after its failure; a failed eager
model stays failed (its error is on ``/ready``).

The budget counts each model's footprint: the largest of its estimate (weights at the engine's
precision, the KV buffers it reserves, a worker's base memory) and every resident size measured
of its worker; loading and unloading models count too. An unload finishes (the worker exited,
killed after ``UNLOAD_TIMEOUT_S``) before the next model starts. A model whose estimate cannot
fit even with every on-demand model unloaded fails at once with a message saying so.

The unload race: an API process counts a request in flight, *then* reads ``load_state``; the
manager writes ``unloading``, *then* reads the in-flight count under its lock (a memory
barrier). At least one of them sees the other: either the request waits for a reload, or the
model is not unloaded.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferflow.config import LoadMode
from inferflow.server.messages import ErrorInfo, StopWorker, WorkerLost
from inferflow.server.process_utils import process_rss
from inferflow.server.shared_state import LOAD_RETRY_S, LoadState, SharedState
from inferflow.telemetry.metrics_export import mark_process_dead, multiprocess_active

if TYPE_CHECKING:
    from inferflow.graph import ServingGraph

logger = logging.getLogger(__name__)

WORKER_BASE_BYTES = 150 * 2**20  # a worker's Python, ONNX Runtime and tokenizer, measured ~140 MB
UNLOAD_TIMEOUT_S = 10.0  # a worker asked to stop is killed after this long
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
UNLOAD_ERROR = ErrorInfo(503, "The model was unloaded.", code="model_unloaded")
CRASH_ERROR = ErrorInfo(
    500,
    "The engine worker crashed while this request was running; it is being restarted.",
    code="worker_crashed",
)


def estimate_model_bytes(graph: ServingGraph) -> int:
    """Host memory an engine worker of ``graph`` will hold: its weights at the engine's
    precision (``executor.precision``, or the torch executor's ``dtype``), the KV buffers its
    layout reserves, and ``WORKER_BASE_BYTES``. (A GPU's memory is not host memory.)"""
    from inferflow.models.safetensors_reader import iter_shards
    from inferflow.scheduling.kv_budget import weights_bytes

    folder = Path(graph.model_path)
    try:
        raw = json.loads((folder / "config.json").read_text())
        dtype = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    except (OSError, ValueError):
        dtype = "float32"
    fp32 = weights_bytes(iter_shards(folder)) * 4 / _DTYPE_BYTES.get(str(dtype), 4)
    layout, budget = graph.kv_layout(), graph.served_context.budget
    return graph.executor.estimate_bytes(layout, fp32, budget) + WORKER_BASE_BYTES


@dataclass
class ManagedModel:
    """One LLM version's worker as the main process sees it."""

    key: str
    model_id: str
    load: LoadMode
    api: Any  # its EngineAPI (the LitAPI whose inference worker is the engine worker)
    shared: SharedState
    estimate_bytes: int
    process: BaseProcess | None = None
    stopping: bool = False  # we asked it to stop (an unload or the shutdown): no crash
    stop_deadline: float = float("inf")  # monotonic time after which a stopping worker is killed
    load_deadline: float = float("inf")  # ... after which an on-demand load is killed (failed)
    killed: bool = False  # the watchdog or a deadline killed it: its death is pending
    measured_bytes: int = 0  # the largest RSS seen of its workers

    def __post_init__(self) -> None:
        self.shared.set_memory_bytes(self.estimate_bytes)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    @property
    def wanted(self) -> bool:
        """Requests wait for it to load."""
        return self.shared.load_waiters > 0

    def footprint(self) -> int:
        """What it counts for against the budget: its estimate or the largest RSS measured."""
        if self.alive and self.process is not None:
            self.measured_bytes = max(self.measured_bytes, process_rss(self.process.pid))
        footprint = max(self.estimate_bytes, self.measured_bytes)
        self.shared.set_memory_bytes(footprint)
        return footprint

    def failed_long_ago(self) -> bool:
        failed_at = float(self.shared.info().get("failed_at") or 0.0)
        return time.time() - failed_at > LOAD_RETRY_S


class ModelManager:
    """Starts, stops and restarts the engine workers of ``models`` (``server`` launches them
    and owns their request queues: ``launch(api)``, ``fresh_queue(api)``, ``queue(api)``)."""

    def __init__(
        self,
        server: Any,
        models: list[ManagedModel],
        budget_bytes: int | None,
        load_timeout_s: float = 300.0,
    ) -> None:
        self.server = server
        self.models = models
        self.budget = budget_bytes
        self.load_timeout_s = load_timeout_s
        self.pending = False  # a load or an unload is under way: the supervisor polls soon

    # --- what the supervisor asks -------------------------------------------------------------
    def processes(self) -> list[BaseProcess]:
        return [m.process for m in self.models if m.process is not None]

    def model_of(self, process: BaseProcess) -> ManagedModel | None:
        return next((m for m in self.models if m.process is process), None)

    def settled(self) -> bool:
        """Every eager model is loaded or failed, and something can be served (an on-demand
        model can, until it fails)."""
        if any(
            m.load is LoadMode.eager and not _ready(m) and m.shared.load_state != LoadState.FAILED
            for m in self.models
        ):
            return False
        return any(
            _ready(m) or (m.load is LoadMode.on_demand and m.shared.load_state != LoadState.FAILED)
            for m in self.models
        )

    def start(self) -> None:
        for m in self.models:
            if m.load is LoadMode.eager:
                self._launch(m)

    def poll(self) -> None:
        """Start the models requests wait for, unloading idle ones to make room; kill a
        worker that did not stop within ``UNLOAD_TIMEOUT_S`` of its unload, or an on-demand
        one that did not load within the load timeout."""
        self.pending = False
        now = time.monotonic()
        for m in self.models:
            if m.process is None or not m.alive:
                continue
            # an eager model may take long to load the first time (an engine build): no deadline
            loading = m.shared.load_state == LoadState.LOADING and m.load is LoadMode.on_demand
            if not (m.stopping or loading):
                continue
            self.pending = True  # come back for its deadline
            late = now > (m.stop_deadline if m.stopping else m.load_deadline)
            if late and not m.killed:
                logger.warning(
                    "model %s: its worker did not %s within %.0f s; killing it", m.model_id,
                    "stop" if m.stopping else "load",
                    UNLOAD_TIMEOUT_S if m.stopping else self.load_timeout_s,
                )
                m.killed = True
                m.process.kill()
        for m in sorted(self.models, key=lambda m: m.shared.last_used):
            state = m.shared.load_state
            if state in (LoadState.LOADED, LoadState.LOADING) or not m.wanted:
                continue
            if state == LoadState.FAILED and (m.load is LoadMode.eager or not m.failed_long_ago()):
                continue  # its error is on /ready; an on-demand model is retried later
            if state == LoadState.UNLOADING or m.alive:  # its old worker is still exiting
                self.pending = True
            elif self._make_room(m):
                self._launch(m)
            elif m.shared.load_state != LoadState.FAILED:
                self.pending = True

    def on_death(self, process: BaseProcess) -> str | None:
        """Handle a worker's exit; returns ``"fatal"`` when the server cannot go on (no model
        can ever serve, or the queue process is gone)."""
        m = self.model_of(process)
        if m is None:
            return None
        if process.pid is not None and multiprocess_active():
            mark_process_dead(process.pid)  # its running/waiting gauges are stale
        # the dead writer's snapshot is stale too (its pid, slots, KV, counters; an unloaded
        # model has none); with no worker this process may write it
        m.shared.clear_stats()
        was_ready = m.shared.ready
        m.shared.set_ready(False)
        killed, m.process, m.killed = m.killed, None, False
        if m.stopping:  # unloaded (or stopped for the shutdown); the supervisor polls next
            m.stopping, m.stop_deadline = False, float("inf")
            m.shared.set_load_state(LoadState.UNLOADED)
            logger.info("model %s unloaded", m.model_id)
            return None
        if m.shared.load_state == LoadState.LOADING and not was_ready:
            error = m.shared.info().get("load_error") or (
                f"it did not load within {self.load_timeout_s:g} s (server.model_load_timeout_s)"
                if killed and m.load is LoadMode.on_demand
                else f"the engine worker exited during load (exit code {process.exitcode})"
            )
            self._fail(m, str(error))
            return None if self._can_serve() else "fatal"
        logger.error(
            "model %s: the engine worker died (exit code %s); failing its requests and %s",
            m.model_id,
            process.exitcode,
            "restarting it" if m.load is LoadMode.eager else "reloading it on the next request",
        )
        try:
            queue = self.server.fresh_queue(m.api)
        except Exception as exc:  # the queue process went down with it: the server must stop
            logger.error("cannot give model %s a new request queue (%s)", m.model_id, exc)
            return "fatal"
        if m.load is LoadMode.eager:
            self._launch(m)
        else:
            m.shared.set_load_state(LoadState.UNLOADED)
        self._notify_lost(m, queue)
        return None

    def watch(self, limit_s: float | None) -> None:
        """Kill (to restart) a loaded worker whose engine thread stopped beating."""
        if limit_s is None:
            return
        for m in self.models:
            if not _ready(m) or m.stopping or m.killed or m.process is None or not m.alive:
                continue
            age = m.shared.heartbeat_age()
            if age > limit_s:
                logger.error(
                    "model %s: engine worker %s gave no heartbeat for %.0f s (limit %.0f s): "
                    "killing it to restart; its requests fail with an explicit error",
                    m.model_id, m.process.pid, age, limit_s,
                )
                m.killed = True
                m.process.kill()  # its death restarts it

    def set_ready(self, ready: bool) -> None:
        for m in self.models:
            m.shared.set_ready(ready)

    def stop_all(self, timeout_s: float) -> None:
        """Ask each worker to stop (it fails what is left), then make sure it is gone."""
        stop = StopWorker(ErrorInfo(503, "The server is shutting down.", code="shutting_down"))
        live = [m for m in self.models if m.alive]
        for m in live:
            m.stopping = True
            try:
                self.server.queue(m.api).put(stop)
            except Exception as exc:
                logger.debug("cannot send StopWorker to %s: %s", m.model_id, exc)
        for m in live:
            process = m.process
            assert process is not None
            process.join(timeout_s)
            if process.is_alive():
                logger.warning("engine worker %s did not stop; terminating it", process.pid)
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)

    # --- loading and unloading ----------------------------------------------------------------
    def _can_serve(self) -> bool:
        """Some model serves, is loading, or is on demand (it may load later)."""
        return any(
            _ready(m) or m.shared.load_state == LoadState.LOADING or m.load is LoadMode.on_demand
            for m in self.models
        )

    def _fail(self, m: ManagedModel, error: str) -> None:
        m.shared.publish_info({"load_error": error, "failed_at": time.time()})
        m.shared.set_load_state(LoadState.FAILED)
        logger.error("model %s failed to load: %s", m.model_id, error)

    def _launch(self, m: ManagedModel) -> None:
        m.shared.publish_info({})
        m.shared.set_load_state(LoadState.LOADING)
        logger.info("model %s: loading", m.model_id)
        m.load_deadline = time.monotonic() + self.load_timeout_s
        m.shared.count_load()
        self.pending = self.pending or m.load is LoadMode.on_demand  # (its deadline: poll soon)
        try:
            m.process = self.server.launch(m.api)
        except Exception as exc:  # e.g. no memory left to spawn it
            self._fail(m, f"cannot start its engine worker: {exc}")

    def _make_room(self, wanted: ManagedModel) -> bool:
        """True when ``wanted`` may start now. Else an idle model is being unloaded for it, or
        the others are busy (the caller tries again later), or it can never fit (failed)."""
        if self.budget is None:
            return True
        held = [m for m in self.models if m is not wanted and m.process is not None]
        if any(m.stopping for m in held):
            return False  # wait for that unload to finish first
        need = wanted.footprint()
        sizes = {m.key: m.footprint() for m in held}
        used = sum(sizes.values())
        if used + need <= self.budget:
            return True
        unloadable = [m for m in held if m.load is LoadMode.on_demand]
        pinned = used - sum(sizes[m.key] for m in unloadable)  # eager models, kept loaded
        if pinned + need > self.budget:
            need = wanted.estimate_bytes  # a past peak of its RSS alone does not rule it out
        if pinned + need > self.budget:
            self._fail(wanted, (
                f"it needs ~{need >> 20} MiB and server.model_memory_budget "
                f"is {self.budget >> 20} MiB, of which the eager models hold {pinned >> 20} MiB "
                "(raise the budget, or lower its executor.kv_cache_memory or precision)"
            ))
            return False
        idle = [
            m for m in unloadable
            if m.alive and m.shared.load_state == LoadState.LOADED and m.shared.in_flight == 0
        ]
        if not idle or used - sum(sizes[m.key] for m in idle) + need > self.budget:
            return False  # only busy models could make room: wait until they are idle
        # one unload at a time: once it has exited (or if a request kept it) look again
        self._unload(min(idle, key=lambda m: m.shared.last_used))
        return False

    def _unload(self, m: ManagedModel) -> bool:
        m.shared.set_load_state(LoadState.UNLOADING)
        if m.shared.in_flight_fenced() > 0:  # a request arrived meanwhile: keep it loaded
            m.shared.set_load_state(LoadState.LOADED)
            return False
        logger.info("model %s: unloading (least recently used, idle) to make room", m.model_id)
        m.shared.count_unload()
        m.stopping, m.stop_deadline = True, time.monotonic() + UNLOAD_TIMEOUT_S
        try:
            self.server.queue(m.api).put(StopWorker(UNLOAD_ERROR))
        except Exception as exc:  # its queue is gone: the shutdown is under way
            logger.debug("cannot send StopWorker to %s: %s", m.model_id, exc)
        return True

    def _notify_lost(self, m: ManagedModel, queue: Any) -> None:
        for consumer_id in self.server.api_consumer_ids():
            try:
                self.server.transport.send(
                    WorkerLost(CRASH_ERROR, queue, deployment=m.key), consumer_id=consumer_id
                )
            except Exception as exc:
                logger.warning("cannot notify API process %d: %s", consumer_id, exc)


def _ready(m: ManagedModel) -> bool:
    return m.shared.ready and m.shared.load_state == LoadState.LOADED
