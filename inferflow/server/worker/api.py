"""The LitAPI that owns the engine inside LitServe's inference worker process.

``setup`` runs in the spawned worker: it builds the engine (the expensive part), runs a warm-up
request through it and publishes the engine's description for ``/version``. Readiness is set by
``EngineLoop`` when it starts consuming requests, so ``/ready`` turns 200 only once a request
sent now would be served.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import litserve as ls

from inferflow.engine.llm_engine import ExecutorWrapper, LLMEngine
from inferflow.outputs import RequestMetrics
from inferflow.sampling_params import SamplingParams
from inferflow.server.messages import SubmitRequest
from inferflow.server.observability import TelemetrySettings, WorkerTelemetry
from inferflow.server.process_utils import die_with_parent, name_process
from inferflow.server.shared_state import LoadState, SharedState
from inferflow.server.worker.loop import EngineLoop
from inferflow.telemetry.timings import RequestTimings

logger = logging.getLogger(__name__)

API_PATH = "/v1/completions"
WARMUP_REQUEST_ID = "inferflow-warmup"


class EngineAPI(ls.LitAPI):
    """Holds ``engine_factory`` (picklable, called once in the worker) and the shared state."""

    def __init__(
        self,
        engine_factory: Callable[[ExecutorWrapper | None], LLMEngine],
        shared: SharedState,
        spec: ls.specs.base.LitSpec | None = None,
        log_level: str = "info",
        telemetry: TelemetrySettings | None = None,
        api_path: str = API_PATH,
        process_name: str = "inferflow-llm",
    ) -> None:
        super().__init__(api_path=api_path, stream=True, loop=EngineLoop(), spec=spec)
        self.process_name = process_name  # 15 bytes at most (the kernel's limit)
        self.engine_factory = engine_factory
        self.shared = shared
        self.log_level = log_level
        self.telemetry_settings = telemetry
        self.engine: LLMEngine | None = None
        self.telemetry: WorkerTelemetry | None = None

    def __getstate__(self) -> dict[str, Any]:
        # The spec (routes, frontend state) lives in the API processes, never in the worker.
        state = self.__dict__.copy()
        state["_spec"] = None
        state["engine"] = None
        state["telemetry"] = None
        return state

    def setup(self, device: str) -> None:
        """Build and warm up the engine (worker process only)."""
        die_with_parent(signal.SIGKILL)
        name_process(self.process_name)  # the engine worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group;
        # the supervisor decides when the worker stops (after the API processes drained).
        _configure_worker_logging(self.log_level)
        try:
            self.load()
        except BaseException as exc:  # LitServe logs it and the worker exits: say why on /ready
            self.shared.publish_info({"load_error": f"{type(exc).__name__}: {exc}"[:2000]})
            raise

    def load(self) -> None:
        """Build the engine, warm it up, start telemetry and publish ``/version``'s description
        (the Ray host's engine replica calls this directly: its process is Ray's)."""
        started = time.time()
        logger.info("worker %d: loading the engine", os.getpid())
        telemetry = None
        if self.telemetry_settings is not None:
            telemetry = WorkerTelemetry(self.telemetry_settings)
        # telemetry wraps the executor as the engine is built, and records from after warm-up
        engine = self.engine = self.engine_factory(telemetry.wrap_executor if telemetry else None)
        warm_up(engine)  # the warm-up is not a request: nothing of it is recorded
        if telemetry is not None:
            telemetry.start_recording()
        self.telemetry = telemetry
        self.shared.publish_info(describe_engine(engine, load_time_s=time.time() - started))
        logger.info("engine ready in %.2f s", time.time() - started)

    @property
    def live_engine(self) -> LLMEngine:
        """The engine (worker process only, after ``setup``)."""
        if self.engine is None:
            raise RuntimeError("the engine is not loaded: setup() runs in the engine worker")
        return self.engine

    def health(self) -> bool:
        """LitServe's health hook (``/_litserve/health``): the engine loaded and consuming.
        inferflow's own ``/health`` (liveness) and ``/ready`` are spec routes (``ops.py``)."""
        return self.shared.ready

    def authorize(self) -> None:
        """LitServe's auth hook, a FastAPI dependency of every route: a no-op. API keys are
        checked by the frontend, so a 401 has OpenAI's shape, the keys come from
        ``server.api_keys`` and ``/health``, ``/ready``, ``/metrics`` stay open."""
        return None

    def predict(self, x: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("EngineLoop drives the engine directly")

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
    ) -> dict[str, Any] | None:
        """The request left the engine; returns its timings (``RequestTimings.to_dict()``)."""
        if self.telemetry is not None:
            timings = self.telemetry.request_done(
                request_id, finish_reason, metrics, num_output_tokens, error
            )
            if timings is not None:
                return timings
        if metrics is None:
            return None
        return RequestTimings.from_metrics(metrics, num_output_tokens or 0).to_dict()

    def publish_stats(self, counters: dict[str, float]) -> None:
        engine = self.live_engine
        stats = engine.stats()
        slots = engine.scheduler_config.max_running  # slots a request can run in
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
        if self.telemetry is not None:
            self.telemetry.engine_state(
                stats.num_running,
                stats.num_waiting,
                stats.num_kv_blocks_used,
                stats.num_kv_blocks_total,
            )

    def token_text(self, token_id: int) -> str:
        return _token_text(self.live_engine.tokenizer, token_id)


def _configure_worker_logging(level: str) -> None:
    """The spawned worker starts with bare logging; give it the server's level and a prefix."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(
            level=level.upper(),
            format="%(asctime)s %(levelname)s [engine worker] %(name)s: %(message)s",
        )


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
            "architecture": engine.model_config.architecture,
            "vocab_size": engine.model_config.vocab_size,
            "num_layers": engine.model_config.num_layers,
            # request defaults and extra EOS ids in effect (source: auto, none or a folder name)
            "generation_config": engine.checkpoint.generation.describe(),
        },
        "worker": {
            "pid": os.getpid(),
            "python": platform.python_version(),
            "platform": sys.platform,
        },
    }
