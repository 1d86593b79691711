"""``InferflowServer``: LitServer with our process lifecycle.

On LitServe's public surface: the FastAPI app and route registration (the OpenAI and
operational routes are spec endpoints, ``OpenAICompatibleSpec``), middleware
(``LitServer(middlewares=...)``: the payload limit and the per-process startup
``ApiProcessStartup``), the ``authorize``/``health`` hooks of ``EngineAPI``, the custom loop
(``LitAPI(loop=EngineLoop())``, a ``LitLoop``), the Manager-backed request queues and the spawning of
the inference worker (``launch_inference_worker`` -> ``inference_worker`` -> ``EngineAPI.setup``
-> ``EngineLoop``). LitServe's own ``/health`` and ``/info`` move to ``/_litserve/...``.

What still overrides LitServe's private surface (LitServe 0.2.19; listed with the reasons in
docs/server.md, pinned by ``tests/server/test_litserve_contract.py``):

- ``run``: the API processes start before the engine is loaded, so ``/health`` answers and
  ``/ready`` says 503 while the model loads; the main process then supervises (``Supervisor``)
  instead of waiting on a Manager event that a signal handler cannot safely touch. It uses its
  own ``_start_manager`` (the Manager dies with us: PR_SET_PDEATHSIG), ``_fork_api_processes``
  (``DrainingServer``: graceful drain, explicit failure of what is left; only the configured
  host) and ``_close_queues``, and LitServe's private queue attributes.
- ``lifespan``: our dispatcher routes typed ``UpdateBatch``/``WorkerLost`` messages to request
  channels, instead of LitServe's tuple reader (the two cannot share a response queue).
- ``fresh_queue``: a restarted worker gets a fresh request queue (LitServe reuses the old
  one, where a Manager thread of the dead worker would swallow the next message).

Several LLMs (the model repository) are several LitAPIs of one server, LitServe's public way
to serve more than one model: one ``EngineAPI`` each, its own ``api_path`` (only a key of its
request queue: the first carries the routes' spec, the others ``QueueOnlySpec``, so LitServe
registers no route for them) and its own inference worker, started and stopped by the
``ModelManager`` through ``launch`` (LitServe's ``launch_single_inference_worker``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import multiprocessing as mp
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from multiprocessing.managers import SyncManager
from multiprocessing.process import BaseProcess
from typing import Any

import litserve as ls
import uvicorn
from fastapi import FastAPI
from litserve.specs.base import LitSpec
from litserve.utils import configure_logging

from inferflow.config.server import ServerConfig
from inferflow.server.http.connections import raise_fd_limit, uvicorn_connection_options
from inferflow.server.http.errors import install_error_handlers
from inferflow.server.http.frontend import Frontend
from inferflow.server.http.limits import DocsKeyMiddleware, PayloadLimitMiddleware
from inferflow.server.http.openapi import install_openapi
from inferflow.server.litserve.direct_transport import DirectTransport
from inferflow.server.litserve.engine_api import API_PATH, EngineAPI
from inferflow.server.litserve.spec import OpenAICompatibleSpec
from inferflow.server.litserve.startup import ApiProcessStartup
from inferflow.server.process.api_process import DrainingServer, run_api_process
from inferflow.server.process.model_manager import ManagedModel, ModelManager
from inferflow.server.process.supervisor import Supervisor
from inferflow.server.process.uvicorn_logs import uvicorn_log_config
from inferflow.server.process_utils import init_queue_process
from inferflow.server.worker.service import WorkerService

logger = logging.getLogger(__name__)

LITSERVE_HEALTH_PATH = "/_litserve/health"  # LitServe's own routes, out of the OpenAI namespace
LITSERVE_INFO_PATH = "/_litserve/info"


class QueueOnlySpec(LitSpec):
    """The spec of every LLM but the first: no routes (the first one's spec serves them all),
    so LitServe registers nothing for its ``api_path``, which only names its request queue."""

    def __init__(self, api_path: str) -> None:
        super().__init__()
        self.api_path = api_path

    @property
    def stream(self) -> bool:
        return True


def engine_api(
    index: int, service: WorkerService, frontend: Frontend, model_path: str, log_level: str
) -> EngineAPI:
    """The LitAPI of the repository's ``index``-th LLM: the first carries the routes' spec,
    every other only names its request queue (``api_path``)."""
    path = API_PATH if index == 0 else f"{API_PATH}/_model/{index}"
    return EngineAPI(
        service,
        spec=OpenAICompatibleSpec(frontend, model_path) if index == 0 else QueueOnlySpec(path),
        log_level=log_level,
        api_path=path,
        process_name="inferflow-llm" if index == 0 else f"inferflow-llm{index}"[:15],
    )


class InferflowServer(ls.LitServer):
    """The LLMs of ``models`` (one ``ManagedModel`` per version; its ``api`` an ``EngineAPI``)
    behind the OpenAI routes; ``run()`` blocks until shutdown."""

    def __init__(
        self,
        models: list[ManagedModel],
        frontend: Frontend,
        settings: ServerConfig,
        model_path: str,
        start_line: str = "",
        memory_budget: int | None = None,
    ) -> None:
        self.frontend = frontend
        self.start_line = start_line  # printed by the supervisor once /ready turns 200
        self.settings = settings
        self.shared = frontend.shared  # the server's: draining, queue lost, ready
        self.model_path = model_path
        self.exit_code = 0
        self.stop_signal: int | None = None  # SIGTERM/SIGINT when a signal stopped it
        self.models = ModelManager(self, models, memory_budget, settings.model_load_timeout_s)
        self._api_processes: dict[int, BaseProcess] = {}
        super().__init__(
            [m.api for m in models],
            accelerator="cpu",
            devices=1,
            workers_per_device=1,
            timeout=False,
            healthcheck_path=LITSERVE_HEALTH_PATH,  # ours: /health (liveness), /ready
            info_path=LITSERVE_INFO_PATH,
            middlewares=[
                (PayloadLimitMiddleware, {"max_bytes": settings.max_payload_bytes}),
                (DocsKeyMiddleware, {"auth": frontend.auth}),
                (ApiProcessStartup, {"frontend": frontend}),
            ],
        )
        install_error_handlers(self.app)
        install_openapi(self.app, frontend.served_model_ids)

    @property
    def transport(self) -> Any:
        return self._transport

    @property
    def manager_process(self) -> BaseProcess | None:
        """The queue (Manager) process, once started (the supervisor watches it)."""
        manager = getattr(self, "_manager", None)
        return getattr(manager, "_process", None)

    def queue(self, api: EngineAPI) -> Any:
        """``api``'s request queue."""
        return self._get_request_queue(api.api_path)

    def launch(self, api: EngineAPI) -> BaseProcess:
        """Start ``api``'s engine worker (spawned: it inherits no file descriptors)."""
        return self.launch_single_inference_worker(api, 0)

    def fresh_queue(self, api: EngineAPI) -> Any:
        """Give ``api`` a new request queue (returned; its API-side copies follow ``WorkerLost``)."""
        queue = self._manager.Queue()
        self.litapi_request_queues[api.api_path] = queue
        return queue

    def api_consumer_ids(self) -> list[int]:
        return list(self._api_processes)

    @asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        """Per API process: request channels fed from this process's response queue."""
        pump = asyncio.create_task(
            self.frontend.registry.pump(self._transport, self.frontend.consumer_id)
        )
        try:
            yield
        finally:
            pump.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(pump, timeout=2.0)

    def _start_manager(self, num_api_servers: int) -> SyncManager:
        manager = SyncManager(ctx=mp.get_context("fork"))
        manager.start(init_queue_process, (signal.SIGKILL,))  # named inferflow-queue
        self._manager = manager
        self.workers_setup_status = manager.dict()
        self._shutdown_event = manager.Event()
        for lit_api in self.litapi_connector:
            self.litapi_request_queues[lit_api.api_path] = manager.Queue()
        # updates go from the workers to the API processes directly, not through the Manager
        self._transport = DirectTransport(num_api_servers)
        return manager

    def run(
        self,
        host: str | None = None,
        port: int | None = None,  # type: ignore[override]
        num_api_servers: int | None = None,
        log_level: str | None = None,
        generate_client_file: bool = False,
        api_server_worker_type: str = "process",
        pretty_logs: bool = False,
        **kwargs: Any,
    ) -> None:
        """Serve until SIGTERM/SIGINT; ``self.exit_code`` is 0 after a clean shutdown,
        ``self.stop_signal`` the signal that stopped it (None: it stopped on its own).

        Defaults come from ``self.settings``; a client file is never written (no littering).
        """
        s = self.settings
        host = host or s.host
        port = s.port if port is None else int(port)
        num_api_servers = num_api_servers or s.num_api_servers
        log_level = log_level or s.log_level
        configure_logging(log_level, use_rich=pretty_logs)
        self.settings = s = replace(s, max_connections=raise_fd_limit(s.max_connections))
        # the Manager is forked first, so it never holds the listening socket
        manager = self._start_manager(num_api_servers)
        # uvicorn's "running on" lines would come before the model loads; the supervisor's
        # start line says when the server is up
        kwargs.setdefault("log_config", uvicorn_log_config())
        sock = uvicorn.Config(
            app=self.app, host=host, port=port, log_level=log_level, log_config=kwargs["log_config"]
        ).bind_socket()
        supervisor = Supervisor(self, {}, s.shutdown_grace_s)
        supervisor.install_signal_handlers()
        try:
            for model in self.models.models:  # every model's queue, known before the fork
                deployment = self.frontend.deployment(model.key)
                assert deployment is not None
                deployment.request_queue = self.queue(model.api)
            self.frontend.load_requests.wake_fd = supervisor.wake_fd
            self.models.start()  # the eager models' workers
            self._api_processes = self._fork_api_processes(
                port, num_api_servers, log_level, [sock], host, **kwargs
            )
            supervisor.api_processes.update(self._api_processes)
            # only the API processes listen now: when a drain closes theirs, new connections
            # are refused at once instead of queueing on a socket nobody accepts from
            sock.close()
            self.exit_code = supervisor.run()
            self.stop_signal = supervisor.stop_signal
        finally:
            supervisor.cleanup()
            self._close_queues(manager)
            sock.close()

    def _fork_api_processes(
        self,
        port: int,
        num_uvicorn_servers: int,
        log_level: str,
        sockets: list[socket.socket],
        host: str = "127.0.0.1",
        **kwargs: Any,
    ) -> dict[int, BaseProcess]:
        """Fork one ``DrainingServer`` process per response queue."""
        processes: dict[int, BaseProcess] = {}
        for consumer_id in range(num_uvicorn_servers):
            self.frontend.consumer_id = consumer_id  # the fork below keeps this value
            app = copy.copy(self.app)
            config = uvicorn.Config(
                app=app,
                host=host,
                port=port,
                log_level=log_level,
                timeout_graceful_shutdown=5,
                **uvicorn_connection_options(self.settings, num_uvicorn_servers),
                **kwargs,
            )
            server = DrainingServer(config, self.frontend, self.settings.shutdown_grace_s)
            process = mp.get_context("fork").Process(
                target=run_api_process, args=(server, sockets), name=f"inferflow-api-{consumer_id}"
            )
            process.start()
            processes[consumer_id] = process
        return processes

    def _close_queues(self, manager: Any) -> None:
        """Last step: every child is gone already (``Supervisor``); close the queues."""
        with contextlib.suppress(Exception):
            self._transport.close(send_sentinel=False)
        with contextlib.suppress(Exception):
            manager.shutdown()
