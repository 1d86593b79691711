"""The Ray host's shutdown (``host.serve_on_ray`` calls :func:`teardown` on SIGTERM/SIGINT).

The app is deleted -- Serve drains its replicas for ``server.shutdown_grace_s`` -- then its
replica board; Serve is shut down if this process started it, then Ray if this process started
it. Each step runs in a thread and is bounded (a replica that died or hangs cannot hold it up);
of a local Ray instance every process still alive ``RAY_EXIT_S`` after ``ray.shutdown`` is
killed. When the local instance's GCS or raylet stops meanwhile (Ctrl+C signals the whole
process group), every step aborts and what is left is killed at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
from typing import Any

from inferflow.config.server import RayServerConfig

logger = logging.getLogger(__name__)

SERVE_STOP_S = 30.0  # serve.delete beyond the drain, serve.shutdown: bounded
RAY_EXIT_S = 10.0  # a local Ray instance's processes get this long to exit after ray.shutdown
CORE_CHECK_S = 0.2  # at shutdown: how long to watch the local GCS/raylet for having stopped too
CORE_NAMES = re.compile(r"gcs_server|raylet")


class _CoreGone(Exception):
    """The local Ray instance's GCS or raylet stopped during the shutdown."""


def _bounded(what: str, fn: Any, timeout: float, core: list[int] | None = None) -> None:
    """Run ``fn()`` in a thread for at most ``timeout`` s (a dead or hung replica must not hold
    the shutdown); a failure or a timeout is logged and the shutdown goes on. With ``core``
    (the local Ray instance's GCS and raylet), raises ``_CoreGone`` as soon as one of them
    exits: the step would wait for a GCS that no longer answers."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name=f"inferflow-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(0.1)
        if core and any(not _alive(p) for p in core):
            raise _CoreGone(what)
    if thread.is_alive():
        logger.warning("inferflow: %s did not finish within %.0f s; going on", what, timeout)
    elif failure:
        logger.warning("inferflow: %s: %s", what, failure[0])


def ray_core_pids() -> list[int]:
    """The local Ray instance's GCS server and raylet (children of this process)."""
    from inferflow.server.process_utils import descendants

    return [p for p in descendants(os.getpid()) if CORE_NAMES.search(_cmdline(p))]


def _core_gone(core: list[int], wait_s: float = CORE_CHECK_S) -> bool:
    """Whether a process of the local Ray instance's core exited (within ``wait_s``): a
    terminal's Ctrl+C, or a signal to the process group, stops Ray's own processes with us."""
    deadline = time.monotonic() + wait_s
    while True:
        if any(not _alive(p) for p in core):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def teardown(
    cfg: RayServerConfig,
    local: bool,
    started_serve: bool,
    core: list[int] | None = None,
    node_id: str = "",
) -> None:
    """Delete the app (its replicas drain for ``shutdown_grace_s``) and its board; shut Serve
    down if this server started it, Ray if it started Ray -- each step bounded. Of a local Ray
    instance, whatever process is still alive ``RAY_EXIT_S`` after ``ray.shutdown`` is killed.
    When the local instance's GCS or raylet is already gone (the signal reached the whole process
    group, as Ctrl+C in a terminal does), every graceful step would wait for a GCS that no longer
    answers: what is left of the instance is killed at once instead, and the process exits
    without Ray's own exit hook (which would wait a minute for the GCS).

    ``node_id``: the local instance's node. Serve's HAProxy (``server.http_proxy``) is a child
    of its manager actor, which Serve kills on shutdown: an orphan by then, no longer among our
    descendants, found by its config path (``/tmp/haproxy-serve/<node id>/...``) instead."""

    from inferflow.server.process_utils import descendants

    core = core if local else None
    try:
        if core and _core_gone(core):
            raise _CoreGone("the signal")
        _graceful_teardown(cfg, local, started_serve, core)
        if local:
            _reap(_orphans(node_id), 0.0, "the shutdown (orphaned)")
    except _CoreGone as gone:
        logger.warning(
            "inferflow: the local Ray instance stopped (during %s); stopping what is left of it",
            gone,
        )
        _reap(descendants(os.getpid()) + _orphans(node_id), 0.0, "its core stopped")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _graceful_teardown(
    cfg: RayServerConfig, local: bool, started_serve: bool, core: list[int] | None
) -> None:
    import ray
    from ray import serve

    from inferflow.server.process_utils import descendants
    from inferflow.server.ray.board import NAMESPACE

    _bounded(
        "serve.delete",
        lambda: serve.delete(cfg.app_name),
        cfg.shutdown_grace_s + SERVE_STOP_S,
        core,
    )

    def kill_board() -> None:
        ray.kill(ray.get_actor(f"{cfg.app_name}-board", namespace=NAMESPACE))

    _bounded("removing the replica board", kill_board, 10, core)
    if started_serve:
        _bounded("serve.shutdown", serve.shutdown, SERVE_STOP_S, core)
    if local:
        ours = descendants(os.getpid())  # Ray's processes, before ray.shutdown re-parents them
        _bounded("ray.shutdown", ray.shutdown, SERVE_STOP_S)
        _reap(ours, RAY_EXIT_S)


def _reap(pids: list[int], timeout: float, after: str = "ray.shutdown") -> None:
    """Wait up to ``timeout`` s for ``pids`` to exit, then SIGKILL the ones left (and reap the
    ones that were our children); ``after``: what they outlived, for the log."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        logger.warning(
            "inferflow: killing Ray process %d (%s), still alive after %s",
            pid,
            _cmdline(pid)[:120],
            after,
        )
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.waitpid(pid, os.WNOHANG)


def _orphans(node_id: str) -> list[int]:
    """Processes of this node's instance that left our process tree: any whose command line
    names the node (Serve's HAProxy reads ``/tmp/haproxy-serve/<node id>/haproxy.cfg``)."""
    if not node_id:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid() and node_id in _cmdline(int(entry), 4096):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie); a zombie child of ours is reaped."""
    with contextlib.suppress(OSError):
        os.waitpid(pid, os.WNOHANG)
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _cmdline(pid: int, limit: int = 120) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:limit]
    except OSError:
        return "?"
