"""``/metrics`` across LitServe's processes: the multiprocess directory, the exposition text, and
the API process's own HTTP metrics.

Server wiring (see docs/observability.md):

1. launcher, before ``LitServer.run()``: ``mp_dir = prepare_multiprocess_dir()`` — LitServe forks
   the API server(s) and spawns the workers afterwards, and they inherit the environment;
2. worker (``LitAPI.setup``): ``EngineMetrics(model_name, engine_index=worker_id)``;
3. API process, ``GET /metrics``: ``body, content_type = render_metrics(server_metrics.registry)``;
4. launcher at exit: ``cleanup_multiprocess_dir(mp_dir)``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    values,
)
from prometheus_client.multiprocess import MultiProcessCollector

from inferflow.telemetry.metrics import REQUEST_LATENCY_BUCKETS

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
DIR_PREFIX = "inferflow-metrics-"  # + the launching pid: a later start removes dead servers' ones


def prepare_multiprocess_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Create (or clear) the metrics directory, export ``PROMETHEUS_MULTIPROC_DIR`` and switch
    this process's prometheus_client to file-backed values.

    Call it in the launching process before LitServe starts its processes and before any metric
    object exists in this process. ``path=None`` makes a fresh temporary directory; an existing
    one is emptied of ``*.db`` files (stale samples of an earlier run would be summed in). The
    caller owns the directory: remove it with :func:`cleanup_multiprocess_dir`.
    """
    if path is None:
        remove_stale_multiprocess_dirs()
    directory = Path(
        tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-") if path is None else path
    )
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()
    os.environ[MULTIPROC_ENV] = str(directory)
    # prometheus_client picks its value class when first imported; re-pick it now that the
    # variable is set, so metrics created from here on write to the directory
    values.ValueClass = values.get_value_class()
    return directory


def remove_stale_multiprocess_dirs(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the metrics folders of servers that died without cleaning up (``kill -9``): a
    folder is ``inferflow-metrics-<pid>-*`` and stale once no process has that pid."""
    removed = []
    for folder in Path(root or tempfile.gettempdir()).glob(f"{DIR_PREFIX}*"):
        pid_text = folder.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit() or _pid_alive(int(pid_text)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def multiprocess_active() -> bool:
    """True when metrics created in this process are file-backed (multiprocess mode)."""
    return values.ValueClass is not values.MutexValue


def cleanup_multiprocess_dir(path: str | os.PathLike[str]) -> None:
    """Remove the directory made by :func:`prepare_multiprocess_dir` (and unset the variable)."""
    shutil.rmtree(path, ignore_errors=True)
    if os.environ.get(MULTIPROC_ENV) == str(path):
        del os.environ[MULTIPROC_ENV]


def mark_process_dead(pid: int, path: str | os.PathLike[str] | None = None) -> None:
    """Forget a dead worker's gauges (running/waiting/KV), keeping its cumulative counters and
    histograms. Call when a worker exits; a restarted worker writes fresh gauge values anyway."""
    directory = Path(path or os.environ[MULTIPROC_ENV])
    for gauge_file in directory.glob(f"gauge_*_{pid}.db"):
        gauge_file.unlink(missing_ok=True)


def render_metrics(
    *registries: CollectorRegistry, multiprocess_dir: str | os.PathLike[str] | None = None
) -> tuple[bytes, str]:
    """Prometheus text exposition for ``GET /metrics`` and its content type.

    With a multiprocess directory (argument, else ``PROMETHEUS_MULTIPROC_DIR``) the samples of all
    processes are merged: counters and histograms summed, gauges from the most recent write.
    ``registries`` are in-memory registries of this process (e.g. ``ServerMetrics.registry``);
    they are added only when this process's values are not file-backed, so nothing counts twice.
    """
    directory = multiprocess_dir or os.environ.get(MULTIPROC_ENV)
    parts: list[bytes] = []
    if directory:
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=str(directory))
        parts.append(generate_latest(merged))
    if not directory or not multiprocess_active():
        parts.extend(generate_latest(registry) for registry in registries)
    return b"".join(parts), CONTENT_TYPE_LATEST


class ServerMetrics:
    """API-process metrics: HTTP responses by route and status code, and their durations."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.model_name = model_name
        self.http_requests = Counter(
            "inferflow:http_requests",
            "HTTP responses by route and status code.",
            ["model_name", "route", "status_code"],
            registry=self.registry,
        )
        self.http_duration = Histogram(
            "inferflow:http_request_duration_seconds",
            "Request received -> response complete, per route (s).",
            ["model_name", "route"],
            registry=self.registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        )
        self.model_load_wait = Histogram(
            "inferflow:model_load_wait_seconds",
            "Time a request waited for its on-demand model to load, by outcome (s).",
            ["model_name", "outcome"],
            registry=self.registry,
            buckets=REQUEST_LATENCY_BUCKETS,
        )

    def on_model_load_wait(self, model_id: str, outcome: str, seconds: float) -> None:
        self.model_load_wait.labels(model_id, outcome).observe(seconds)

    def on_response(self, route: str, status_code: int, duration_s: float | None = None) -> None:
        """Count one response (call it for errors too: 400, 401, 413, 429, 503, 504 ...)."""
        self.http_requests.labels(self.model_name, route, str(status_code)).inc()
        if duration_s is not None:
            self.http_duration.labels(self.model_name, route).observe(duration_s)
