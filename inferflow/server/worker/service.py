"""``WorkerService``: what the engine loop needs beside the engine, whichever host runs it.

It builds the engine (``load``: build, warm up, start telemetry, publish ``/version``'s
description), and is the loop's one door to the rest of the server: the heartbeat and
readiness in ``SharedState``, the engine's stats, a request's telemetry from accepted to done,
and the text of a token. LitServe's engine worker (``server/litserve/engine_api.py``) and the
Ray replica (``server/ray/engine_replica.py``) each hold one; neither the service nor the loop
knows which host runs them.
"""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from inferflow.engine.llm_engine import ExecutorWrapper, LLMEngine
from inferflow.lora import LoraError
from inferflow.outputs import RequestMetrics
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.updates import SchedulerStats
from inferflow.server.lora import LoraServing, lora_state
from inferflow.server.messages import SubmitRequest
from inferflow.server.observability import TelemetrySettings, WorkerTelemetry
from inferflow.server.shared_state import LoadState, SharedState
from inferflow.telemetry.timings import RequestTimings

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "inferflow-warmup"

EngineFactory = Callable[[ExecutorWrapper | None], LLMEngine]


@dataclass(frozen=True)
class GraphEngineFactory:
    """Rebuilds the graph from its plain config in the worker process and creates the engine."""

    config: dict[str, Any]

    def __call__(self, wrap_executor: ExecutorWrapper | None = None) -> LLMEngine:
        from inferflow.graph import build_graph  # the engine's modules load where it runs

        return build_graph(self.config).create_engine(wrap_executor)


class WorkerService:
    """Holds ``engine_factory`` (picklable, called once where the engine runs) and the shared
    state of the model; the engine and its telemetry exist after ``load``.

    ``lora``: the model's LoRA settings (None: it serves no adapters). The service keeps the
    path of every adapter the engine serves (configured, then loaded at run time) and publishes
    them with the engine's adapter stats into ``SharedState.lora``: what the API processes route
    ``model=ADAPTER`` by."""

    def __init__(
        self,
        engine_factory: EngineFactory,
        shared: SharedState,
        telemetry: TelemetrySettings | None = None,
        lora: LoraServing | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.shared = shared
        self.telemetry_settings = telemetry
        self.lora = lora
        self.lora_paths: dict[str, str] = dict(lora.adapters) if lora is not None else {}
        self.engine: LLMEngine | None = None
        self.telemetry: WorkerTelemetry | None = None

    def load(self) -> None:
        """Build the engine, warm it up, start telemetry and publish ``/version``'s
        description."""
        started = time.time()
        logger.info("worker %d: loading the engine", os.getpid())
        settings = self.telemetry_settings
        telemetry = WorkerTelemetry(settings) if settings is not None else None
        # telemetry wraps the executor as the engine is built, and records from after warm-up
        engine = self.engine = self.engine_factory(telemetry.wrap_executor if telemetry else None)
        self.restore_lora()
        warm_up(engine)  # the warm-up is not a request: nothing of it is recorded
        if telemetry is not None:
            telemetry.start_recording()
        self.telemetry = telemetry
        self.shared.publish_info(describe_engine(engine, load_time_s=time.time() - started))
        logger.info("engine ready in %.2f s", time.time() - started)

    @property
    def live_engine(self) -> LLMEngine:
        """The engine (after ``load``)."""
        if self.engine is None:
            raise RuntimeError("the engine is not loaded: load() runs where the engine runs")
        return self.engine

    def heartbeat(self) -> None:
        """The engine thread is alive (read by readiness and the supervisor's watchdog)."""
        self.shared.beat()

    def mark_ready(self) -> None:
        self.shared.set_ready(True)
        self.shared.set_load_state(LoadState.LOADED)  # the one load_state write of the worker

    def close(self) -> None:
        """Flush telemetry: a multiprocessing child exits without running atexit hooks."""
        if self.telemetry is not None:
            self.telemetry.shutdown()

    def request_added(self, request: SubmitRequest, accepted_time: float) -> None:
        """The engine accepted ``request`` at ``accepted_time`` (telemetry: its queue time
        starts)."""
        if self.telemetry is not None:
            self.telemetry.request_added(request, accepted_time)

    def request_done(
        self,
        request_id: str,
        finish_reason: str,
        metrics: RequestMetrics | None,
        num_output_tokens: int | None,
        error: str | None = None,
    ) -> RequestTimings | None:
        """The request left the engine; returns its timings."""
        if self.telemetry is not None:
            timings = self.telemetry.request_done(
                request_id, finish_reason, metrics, num_output_tokens, error
            )
            if timings is not None:
                return timings
        if metrics is None:
            return None
        return RequestTimings.from_metrics(metrics, num_output_tokens or 0)

    def publish_stats(self, counters: dict[str, float]) -> None:
        engine = self.live_engine
        stats = engine.stats()
        slots = engine.scheduler.max_running  # slots a request can run in
        self.shared.publish_stats(
            {
                **counters,
                "running": stats.num_running,
                "waiting": stats.num_waiting,
                "total_slots": slots,
                "free_slots": slots - stats.num_running,
                "kv_blocks_total": stats.num_kv_blocks_total,
                "kv_blocks_free": stats.num_kv_blocks_free,
                "num_steps": stats.num_steps,
                "prefix_cache_queries": stats.prefix_cache_queries,
                "prefix_cache_hits": stats.prefix_cache_hits,
                "updated_at": time.time(),
            },
            executor=engine.model_executor.stats(),
        )
        self.publish_lora(stats)
        if self.telemetry is not None:
            self.telemetry.engine_state(
                stats.num_running,
                stats.num_waiting,
                stats.num_kv_blocks_used,
                stats.num_kv_blocks_total,
            )

    # --- LoRA adapters (engine thread only) -------------------------------------------------
    def restore_lora(self) -> None:
        """Serve the adapters this model's previous worker served (``SharedState.lora`` keeps
        them when a worker exits: an on-demand model unloaded to make room, a crash), so that
        runtime loads and unloads survive a reload; nothing to do on the model's first load.
        An adapter that cannot be read any more is dropped with a warning (its requests are
        then a 404, as after an unload)."""
        previous = self.shared.lora().get("adapters")
        if self.lora is None or not isinstance(previous, list):
            return
        wanted = {
            str(a["name"]): str(a.get("path", ""))
            for a in previous
            if isinstance(a, dict) and "name" in a
        }
        engine = self.live_engine
        for name in engine.lora_names():
            if name not in wanted:  # unloaded at run time
                engine.unload_lora(name)
                self.lora_paths.pop(name, None)
        for name, path in wanted.items():
            if name in self.lora_paths:
                continue
            try:
                engine.load_lora(name, path)
            except LoraError as exc:
                logger.warning("adapter %s (%s) is not restored: %s", name, path, exc)
                continue
            self.lora_paths[name] = path
        logger.info("restored LoRA adapters: %s", ", ".join(sorted(self.lora_paths)) or "none")
        self.publish_lora()

    def load_lora(self, name: str, path: str) -> None:
        """Load adapter ``name`` from ``path`` into the engine (``LoraError`` naming the field
        when it cannot be served) and publish the new adapter list."""
        self.live_engine.load_lora(name, path)
        self.lora_paths[name] = path
        self.publish_lora()

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (running requests of it finish) and publish."""
        self.live_engine.unload_lora(name)
        self.lora_paths.pop(name, None)
        self.publish_lora()

    def lora_names(self) -> list[str]:
        """The adapters the engine serves now (the source of truth), [] without LoRA."""
        if self.lora is None:
            return []
        return list(self.live_engine.lora_names())

    def publish_lora(self, stats: SchedulerStats | None = None) -> None:
        """The engine's adapters (with their paths), the adapters of its running and waiting
        requests and its load/unload counters into ``SharedState.lora`` (written only when
        something changed)."""
        if self.lora is None:
            return
        engine = self.live_engine
        names = self.lora_names()
        adapters = {name: self.lora_paths.get(name, "") for name in names}
        stats = stats if stats is not None else engine.stats()
        self.shared.publish_lora(
            lora_state(
                adapters,
                list(stats.running_loras),
                list(stats.waiting_loras),
                self.lora.max_loras,
                stats.lora_loads,
                stats.lora_unloads,
                stats.lora_slot_loads,
            )
        )

    def token_text(self, token_id: int) -> str:
        return _token_text(self.live_engine.tokenizer, token_id)


@lru_cache(maxsize=65536)
def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _folder_name(path: str | None) -> str | None:
    """A folder's name only: ``/version`` shows no filesystem paths."""
    return None if path is None else os.path.basename(path.rstrip("/"))


def warm_up(engine: LLMEngine) -> None:
    """Run one short greedy request to completion (compiles kernels, touches every buffer)."""
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("warm up") or [0]
    engine.add_request(WARMUP_REQUEST_ID, prompt, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()


def describe_engine(engine: LLMEngine, load_time_s: float) -> dict[str, Any]:
    """Versions and shape of the engine, for ``GET /version``: read back from the live
    components, so the backend is the one that runs and every setting the one in effect."""
    described = engine.describe()
    layout = engine.layout
    return {
        "engine": {
            "backend": described.pop("backend"),
            "runtime_version": described.pop("runtime_version"),
            "compiled_engine": _folder_name(described.pop("compiled_engine", None)),
            "max_model_len": layout.max_model_len,
            "max_slots": layout.max_slots,
            "block_size": layout.block_size,
            "num_kv_blocks": layout.num_blocks,
            "load_time_s": round(load_time_s, 3),
            **described,  # layout, scheduler, executor and detokenizer settings
        },
        "model": {
            **engine.model_config.describe(),  # architecture, shape, family traits
            "vocab_size": engine.model_config.vocab_size,
            # request defaults and extra EOS ids in effect (source: auto, none or a folder name)
            "generation_config": engine.checkpoint.generation.describe(),
        },
        "worker": {
            "pid": os.getpid(),
            "python": platform.python_version(),
            "platform": sys.platform,
        },
    }
