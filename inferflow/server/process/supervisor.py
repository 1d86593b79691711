"""The main process after start-up: watch the children, restart a crashed worker, shut down.

It blocks in ``multiprocessing.connection.wait`` on the children's sentinels and a self-pipe
written by the signal handler, so it uses no CPU while nothing happens and reacts at once.

- SIGTERM/SIGINT: mark the server draining (``/ready`` 503, new requests 503), send SIGTERM to
  the API processes (they drain, see ``api_process``), and once they are gone stop the engine
  worker and the Manager. A second signal cuts the grace period short; past a hard deadline
  stragglers are killed. Every child is also bound to us with PR_SET_PDEATHSIG.
- Engine workers, one per LLM version, are the ``ModelManager``'s (``model_manager.py``): it
  loads eager models at start and on-demand ones when an API process asks (a byte on the wake-up
  pipe), unloads within the memory budget, and handles a worker's exit. A worker that died
  after it was ready: its model's readiness drops, a new worker is started on a fresh request
  queue (on-demand: on the next request), and every API process switches to that queue and
  fails that model's in-flight requests (``WorkerLost`` -> 500). Died before it was ever ready
  (load failed): the model is reported failed; when no model is left to serve, the server
  shuts down with exit code 1.
- An API process died on its own: the server shuts down with exit code 1.
- The queue (Manager) process died: the request queues went with it, so nothing can reach a
  worker any more (no request, cancellation or stop). The API processes fail their in-flight
  requests at once (``queue_lost``, an SSE error event for streams; a worker that notices first
  fails them with the same error over the direct transport) and the server shuts down with exit code 1
  and one log line saying why, for the process supervisor (systemd, Kubernetes) to restart it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any

logger = logging.getLogger(__name__)

HARD_DEADLINE_MARGIN_S = 15.0  # beyond the grace period, before API processes are killed
WORKER_STOP_TIMEOUT_S = 10.0
READY_POLL_S = 0.25  # while the engine loads: how often to look for readiness (then: no polling)
WATCHDOG_POLL_S = 1.0  # how often the watchdog reads the engine's heartbeat


class Supervisor:
    """Owns the child processes of one server (``server`` is the ``InferflowServer``)."""

    def __init__(self, server: Any, api_processes: dict[int, BaseProcess], grace_s: float) -> None:
        self.server = server
        self.api_processes = api_processes
        self.grace_s = grace_s
        self.exit_code = 0
        self.stopping = False
        self.stop_signal: int | None = None  # the signal that began the shutdown, if one did
        self._hard_deadline = float("inf")
        self._signals: list[int] = []
        # the wake-up pipe; API processes (forked later) write to ``wake_fd`` when a request
        # waits for a model that is not loaded
        self._wake_r, self.wake_fd = os.pipe()
        os.set_blocking(self.wake_fd, False)
        self._main_pid = os.getpid()
        self._dead: set[BaseProcess] = set()  # children whose exit has been handled
        self._announced = False  # the start line is printed once, when /ready first turns 200
        settings = getattr(server, "settings", None)
        self._watchdog_s: float | None = getattr(settings, "worker_watchdog_s", None)
        self.models = server.models  # ModelManager: the engine workers

    # --- signals ------------------------------------------------------------------------------
    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        if os.getpid() != self._main_pid:  # a forked child before it installed its own handlers
            return
        self._signals.append(sig)
        with contextlib.suppress(BlockingIOError):
            os.write(self.wake_fd, b"\0")

    def _take_signals(self) -> list[int]:
        with contextlib.suppress(BlockingIOError):
            os.read(self._wake_r, 4096)
        taken, self._signals = self._signals, []
        return taken

    # --- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Block until the server has shut down; returns the process exit code."""
        os.set_blocking(self._wake_r, False)
        while True:
            for sig in self._take_signals():
                self._on_shutdown_signal(sig)
            for process in self._newly_dead():
                self._on_death(process)
            if self.stopping and all(p in self._dead for p in self.api_processes.values()):
                break
            if self.stopping and time.monotonic() >= self._hard_deadline:
                self._kill_api_processes()
                continue
            if not self.stopping:
                self.models.poll()  # loads API processes asked for, within the memory budget
            self._announce_when_ready()
            if not self.stopping and self.server.shared.ready:
                self.models.watch(self._watchdog_s)
            timeout = None if self._announced else READY_POLL_S  # blocks once announced
            if self.models.pending:  # a load waits for an unload or for a model to go idle
                timeout = READY_POLL_S
            if self._watchdog_s is not None:
                timeout = min(timeout or WATCHDOG_POLL_S, WATCHDOG_POLL_S)
            if self.stopping:
                timeout = max(0.0, self._hard_deadline - time.monotonic())
            # Watch every child whose death is not handled yet. (Filtering on is_alive() here
            # would race: a sentinel turns readable slightly before the child can be reaped.)
            watched = {p.sentinel: p for p in self._children() if p not in self._dead}
            for fd in wait([self._wake_r, *watched], timeout):
                if fd in watched:
                    watched[fd].join(2.0)  # it is exiting: reap it before the next check
        self.models.stop_all(WORKER_STOP_TIMEOUT_S)
        return self.exit_code

    def _announce_when_ready(self) -> None:
        if self._announced or self.stopping or not self.models.settled():
            return
        self._announced = True
        self.server.shared.set_ready(True)  # the server's: every eager model settled
        line = getattr(self.server, "start_line", "")
        if line:
            print(line, flush=True)

    def _children(self) -> list[BaseProcess]:
        # the Manager first: when it and the worker it took down are seen dead together, the
        # worker's death must not be taken for a crash to restart from (no queue to restart on)
        return [*self._manager(), *self.models.processes(), *self.api_processes.values()]

    def _manager(self) -> list[BaseProcess]:
        process = getattr(self.server, "manager_process", None)
        return [process] if process is not None else []

    def _newly_dead(self) -> list[BaseProcess]:
        dead = [p for p in self._children() if p not in self._dead and not p.is_alive()]
        self._dead.update(dead)
        return dead

    def _on_death(self, process: BaseProcess) -> None:
        if process in self._manager():
            self._on_manager_death(process)
        elif process in self.api_processes.values():
            if not self.stopping:
                logger.error(
                    "API process %s exited unexpectedly (exit code %s); shutting down",
                    process.pid,
                    process.exitcode,
                )
                self.begin_shutdown(exit_code=1)
        elif (
            not self.stopping
            and not self.server.shared.queue_lost  # else it stopped because its queue went away
            and self.models.on_death(process) == "fatal"
        ):
            logger.error("no model could be loaded; shutting down")
            self.begin_shutdown(exit_code=1)

    def _on_shutdown_signal(self, sig: int) -> None:
        name = signal.Signals(sig).name
        if not self.stopping:
            logger.info("%s received: draining (grace %.1f s)", name, self.grace_s)
            self.stop_signal = sig
            self.begin_shutdown()
        else:
            logger.info("%s received again: failing in-flight requests now", name)
            self._signal_api_processes()
            self._hard_deadline = min(self._hard_deadline, time.monotonic() + 5.0)

    def begin_shutdown(self, exit_code: int = 0) -> None:
        self.exit_code = self.exit_code or exit_code
        if self.stopping:
            return
        self.stopping = True
        self.server.shared.set_draining()
        self._hard_deadline = time.monotonic() + self.grace_s + HARD_DEADLINE_MARGIN_S
        self._signal_api_processes()

    def _signal_api_processes(self) -> None:
        for process in self.api_processes.values():
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    def _kill_api_processes(self) -> None:
        for process in self.api_processes.values():
            if process.is_alive():
                logger.warning("API process %s did not stop in time; killing it", process.pid)
                process.kill()
                process.join(2.0)

    # --- children dying -----------------------------------------------------------------------
    def _on_manager_death(self, process: BaseProcess) -> None:
        shared = self.server.shared
        shared.set_queue_lost()  # API processes: fail in-flight requests now, do not drain
        shared.set_ready(False)
        self.models.set_ready(False)
        if self.stopping:
            return
        logger.error(
            "the queue process (pid %s) exited unexpectedly (exit code %s): the request queues "
            "are gone, so in-flight requests fail and the server shuts down "
            "(exit code 1) to be restarted",
            process.pid,
            process.exitcode,
        )
        self.begin_shutdown(exit_code=1)

    def cleanup(self) -> None:
        """Make sure no child outlives ``run`` (also after a start-up failure)."""
        self.begin_shutdown()
        for process in self.api_processes.values():
            process.join(2.0)
        self._kill_api_processes()
        self.models.stop_all(WORKER_STOP_TIMEOUT_S)
