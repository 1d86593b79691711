"""The LitAPI that runs the engine inside LitServe's inference worker process.

``setup`` runs in the spawned worker: it builds the engine through the ``WorkerService`` (the
expensive part: build, warm-up, ``/version``'s description); LitServe then calls the loop entry
(``WorkerLoop.__call__``), which starts the intake and sender threads and runs ``EngineLoop``.
Readiness is set by ``EngineLoop`` when it starts consuming requests, so ``/ready`` turns 200
only once a request sent now would be served.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, cast

import litserve as ls
from litserve.callbacks import CallbackRunner
from litserve.loops import LitLoop

from inferflow.server.process_utils import die_with_parent, name_process
from inferflow.server.worker.loop import EngineLoop
from inferflow.server.worker.queues import Inbox, Outbox, RequestSource, UpdateSink, pump_requests
from inferflow.server.worker.service import WorkerService

logger = logging.getLogger(__name__)

API_PATH = "/v1/completions"


class EngineAPI(ls.LitAPI):
    """Holds the model's ``WorkerService`` (picklable: its engine is built in the worker)."""

    def __init__(
        self,
        service: WorkerService,
        spec: ls.specs.base.LitSpec | None = None,
        log_level: str = "info",
        api_path: str = API_PATH,
        process_name: str = "inferflow-llm",
    ) -> None:
        super().__init__(api_path=api_path, stream=True, loop=WorkerLoop(), spec=spec)
        self.process_name = process_name  # 15 bytes at most (the kernel's limit)
        self.service = service
        self.log_level = log_level

    def __getstate__(self) -> dict[str, Any]:
        # The spec (routes, frontend state) lives in the API processes, never in the worker.
        return {**self.__dict__, "_spec": None}

    def setup(self, device: str) -> None:
        """Build and warm up the engine (worker process only)."""
        die_with_parent(signal.SIGKILL)
        name_process(self.process_name)  # the engine worker
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group;
        # the supervisor decides when the worker stops (after the API processes drained).
        if not logging.getLogger().handlers:  # a spawned worker starts with bare logging
            logging.basicConfig(
                level=self.log_level.upper(),
                format="%(asctime)s %(levelname)s [engine worker] %(name)s: %(message)s",
            )
        try:
            self.service.load()
        except BaseException as exc:  # LitServe logs it and the worker exits: say why on /ready
            self.service.shared.publish_info({"load_error": f"{type(exc).__name__}: {exc}"[:2000]})
            raise

    def health(self) -> bool:
        """LitServe's health hook (``/_litserve/health``): the engine loaded and consuming.
        inferflow's own ``/health`` (liveness) and ``/ready`` are spec routes (``ops.py``)."""
        return self.service.shared.ready

    def authorize(self) -> None:
        """LitServe's auth hook: a no-op (else ``LIT_SERVER_API_KEY`` would guard every route).
        The frontend checks ``server.api_keys``, so a 401 has OpenAI's shape."""


class WorkerLoop(LitLoop):
    """LitServe's loop entry (what ``inference_worker`` calls), adapted to ``EngineLoop``."""

    def __call__(
        self,
        lit_api: ls.LitAPI,
        device: str,
        worker_id: int,
        request_queue: Any,
        transport: Any,
        workers_setup_status: dict[int, str],
        callback_runner: CallbackRunner,
    ) -> None:
        run_worker(cast(EngineAPI, lit_api).service, request_queue, transport)


def run_worker(service: WorkerService, requests: RequestSource, transport: UpdateSink) -> None:
    """The worker's three threads: intake (``requests`` -> inbox), the engine thread (this one)
    and the sender (outbox -> ``transport``); returns when the loop stops."""
    inbox, outbox = Inbox(), Outbox(transport)
    outbox.start()
    intake = threading.Thread(
        target=pump_requests, args=(requests, inbox), name="inferflow-intake", daemon=True
    )
    intake.start()
    try:
        EngineLoop().run(service, inbox, outbox)
    finally:
        outbox.close()
        service.close()

