"""The model repository in the main process: one engine worker per LLM version.

The supervisor calls ``poll()`` each time it wakes (a child died, a signal, or an API process
wrote a byte to its wake-up pipe after setting a model's ``load_requested``), and ``on_death``
for each worker that exited. Nothing here polls on its own: while no load is pending the
supervisor blocks and an idle server uses no CPU.

Per model (``ManagedModel``), ``SharedState.load_state`` moves::

    unloaded --load--> loading --worker ready--> loaded --unload--> unloading --exit--> unloaded
                          \\--exit before ready--> failed          (crash) --> restart / unloaded

Eager models load at start and are restarted after a crash; on-demand models load when a
request wants them and are unloaded, least recently used first and only when idle, when
loading another would exceed ``server.model_memory_budget``. The budget counts each loaded
worker's measured resident memory, and for a model not yet loaded an estimate (its last
measured RSS, else its weights' size at the engine's precision plus a worker's base memory).
An unload finishes (the worker has exited) before the next model starts, so the workers
together stay within the budget.

The unload race: an API process counts a request in flight, *then* reads ``load_state``; the
manager writes ``unloading``, *then* reads the in-flight count under its lock (a memory
barrier). At least one of them sees the other: either the request waits for a reload, or the
model is not unloaded.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from inferflow.config import LoadMode
from inferflow.server.http.errors import ErrorInfo
from inferflow.server.messages import StopWorker, WorkerLost
from inferflow.server.process.process_utils import process_rss
from inferflow.server.process.shared_state import LoadState, SharedState
from inferflow.telemetry.metrics_export import mark_process_dead, multiprocess_active

logger = logging.getLogger(__name__)

WORKER_BASE_BYTES = 150 * 2**20  # a worker's Python, ONNX Runtime and tokenizer, measured ~140 MB
_PRECISION_FACTOR = {"fp32": 1.0, "fp16": 0.5, "bf16": 0.5, "int8": 0.3, "int4": 0.2}
_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
UNLOAD_ERROR = ErrorInfo(503, "The model was unloaded.", code="model_unloaded")
CRASH_ERROR = ErrorInfo(
    500,
    "The engine worker crashed while this request was running; it is being restarted.",
    code="worker_crashed",
)


def estimate_model_bytes(model_path: str, precision: str | None) -> int:
    """A worker's memory before it was ever measured: weights at the engine's precision plus
    ``WORKER_BASE_BYTES`` (the KV buffers of small models are within that base)."""
    folder = Path(model_path)
    on_disk = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    try:
        dtype = json.loads((folder / "config.json").read_text()).get("torch_dtype", "float32")
    except (OSError, ValueError):
        dtype = "float32"
    fp32 = on_disk * 4 / _DTYPE_BYTES.get(str(dtype), 4)
    return int(fp32 * _PRECISION_FACTOR.get(str(precision or "fp32"), 1.0)) + WORKER_BASE_BYTES


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
    measured_bytes: int = 0  # the largest RSS seen of its workers
    restarts: int = field(default=0)

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def footprint(self) -> int:
        """Memory it holds now (measured) or will hold once loaded (estimated)."""
        rss = process_rss(self.process.pid if self.alive and self.process else None)
        self.measured_bytes = max(self.measured_bytes, rss)
        return max(rss, self.measured_bytes or self.estimate_bytes)


class ModelManager:
    """Starts, stops and restarts the engine workers of ``models`` (``server`` launches them
    and owns their request queues: ``launch(api)``, ``fresh_queue(api)``, ``queue(api)``)."""

    def __init__(self, server: Any, models: list[ManagedModel], budget_bytes: int | None) -> None:
        self.server = server
        self.models = models
        self.budget = budget_bytes
        self.pending = False  # a load waits for memory: the supervisor should poll again soon

    # --- what the supervisor asks -------------------------------------------------------------
    def processes(self) -> list[BaseProcess]:
        return [m.process for m in self.models if m.process is not None]

    def model_of(self, process: BaseProcess) -> ManagedModel | None:
        return next((m for m in self.models if m.process is process), None)

    def settled(self) -> bool:
        """Every eager model is loaded or failed, and something can be served."""
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
        """Start the models requests are waiting for, unloading idle ones to make room."""
        self.pending = False
        for m in sorted(self.models, key=lambda m: m.shared.last_used):
            state = m.shared.load_state
            if state == LoadState.LOADED:
                m.shared.set_load_requested(False)
                continue
            wanted = m.shared.load_requested or m.shared.in_flight > 0
            if not wanted or state in (LoadState.LOADING, LoadState.FAILED):
                continue  # a failed model stays failed (its error is on /ready)
            if state == LoadState.UNLOADING or m.alive:  # its old worker is still exiting
                self.pending = True
            elif self._make_room(m):
                self._launch(m)
            else:
                self.pending = True

    def on_death(self, process: BaseProcess) -> str | None:
        """Handle a worker's exit; returns ``"fatal"`` when nothing can be served any more."""
        m = self.model_of(process)
        if m is None:
            return None
        if process.pid is not None and multiprocess_active():
            mark_process_dead(process.pid)  # its running/waiting gauges are stale
        was_ready = m.shared.ready
        m.shared.set_ready(False)
        m.process = None
        if m.stopping:  # unloaded (or stopped for the shutdown)
            m.stopping = False
            m.shared.set_load_state(LoadState.UNLOADED)
            logger.info("model %s unloaded", m.model_id)
            self.poll()
            return None
        if m.shared.load_state == LoadState.LOADING and not was_ready:
            m.shared.set_load_state(LoadState.FAILED)
            logger.error(
                "model %s: the engine worker exited during load (exit code %s): %s",
                m.model_id,
                process.exitcode,
                m.shared.info().get("load_error", "see the error above"),
            )
            return None if self.settled() or self._loading() else "fatal"
        logger.error(
            "model %s: the engine worker died (exit code %s); failing its requests and %s",
            m.model_id,
            process.exitcode,
            "restarting it" if m.load is LoadMode.eager else "reloading it on the next request",
        )
        queue = self.server.fresh_queue(m.api)
        m.restarts += 1
        if m.load is LoadMode.eager:
            self._launch(m)
        else:
            m.shared.set_load_state(LoadState.UNLOADED)
            m.shared.set_load_requested(False)
        self._notify_lost(m, queue)
        return None

    def watch(self, limit_s: float | None) -> None:
        """Kill (to restart) a loaded worker whose engine thread stopped beating."""
        if limit_s is None:
            return
        for m in self.models:
            if not _ready(m) or not m.alive or m.stopping or m.process is None:
                continue
            age = m.shared.heartbeat_age()
            if age > limit_s and m.process.pid is not None:
                logger.error(
                    "model %s: engine worker %s gave no heartbeat for %.0f s (limit %.0f s): "
                    "killing it to restart; its requests fail with an explicit error",
                    m.model_id, m.process.pid, age, limit_s,
                )
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
    def _loading(self) -> bool:
        return any(m.shared.load_state == LoadState.LOADING for m in self.models)

    def _launch(self, m: ManagedModel) -> None:
        m.shared.set_load_state(LoadState.LOADING)
        m.shared.set_load_requested(False)
        m.shared.publish_info({})
        logger.info("model %s: loading", m.model_id)
        m.process = self.server.launch(m.api)

    def _make_room(self, wanted: ManagedModel) -> bool:
        """True when ``wanted`` may start now; else an idle model is being unloaded for it (or
        every other model is busy) and the caller tries again later."""
        if self.budget is None:
            return True
        held = [m for m in self.models if m is not wanted and m.process is not None]
        if any(m.shared.load_state == LoadState.UNLOADING for m in held):
            return False  # wait for that unload to finish first
        need = wanted.footprint()
        used = sum(m.footprint() for m in held)
        if used + need <= self.budget:
            return True
        idle = [
            m for m in held
            if m.load is LoadMode.on_demand and m.shared.load_state == LoadState.LOADED
        ]
        for victim in sorted(idle, key=lambda m: m.shared.last_used):
            if self._unload(victim):
                return False  # start once it has exited (on_death polls again)
        if not held:
            logger.warning(
                "model %s needs ~%d MB, more than server.model_memory_budget (%d MB): loading "
                "it anyway, alone", wanted.model_id, need >> 20, self.budget >> 20,
            )
            return True
        return False  # every other model is busy: the request waits (up to its load timeout)

    def _unload(self, m: ManagedModel) -> bool:
        m.shared.set_load_state(LoadState.UNLOADING)
        if m.shared.in_flight_fenced() > 0:  # a request arrived meanwhile: keep it loaded
            m.shared.set_load_state(LoadState.LOADED)
            return False
        logger.info("model %s: unloading (least recently used, idle) to make room", m.model_id)
        m.stopping = True
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
