"""Export failures that do not flood the log: the first one in full, then a summary a minute.

With ``tracing=otlp`` and no collector listening, OpenTelemetry's exporters log a failure for
every batch of every process (about one a second on a server). :class:`ExportFailureLog` is a
logging filter on those loggers: it lets the first failure through (with a note that more are
summarised), drops the rest, and every ``interval_s`` turns the next one into a count.
"""

from __future__ import annotations

import logging
import threading
import time

# Loggers of the exporters and the batch processor that report failed exports.
EXPORT_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.sdk.trace.export",
)
# Lines that only say an exporter is shutting down: not failures worth a line.
_SHUTDOWN_NOISE = ("already shutdown", "Shutdown in progress")


class ExportFailureLog(logging.Filter):
    """See the module docstring; ``interval_s`` is the summary period."""

    def __init__(self, target: str, interval_s: float = 60.0) -> None:
        super().__init__()
        self.target = target
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._first_at: float | None = None
        self._window_start = 0.0
        self._suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        if any(noise in message for noise in _SHUTDOWN_NOISE):
            return False
        now = time.monotonic()
        with self._lock:
            if self._first_at is None:
                self._first_at = self._window_start = now
                record.msg = (
                    f"{message} (trace export to {self.target} is failing; further failures "
                    f"are summarised every {self.interval_s:.0f} s)"
                )
                record.args = ()
                return True
            self._suppressed += 1
            if now - self._window_start < self.interval_s:
                return False
            record.msg = (
                f"trace export to {self.target}: {self._suppressed} more failure(s) in the last "
                f"{now - self._window_start:.0f} s (is the collector running?)"
            )
            record.args = ()
            record.exc_info = None
            self._window_start, self._suppressed = now, 0
            return True


def install(target: str, interval_s: float = 60.0) -> ExportFailureLog:
    """Put one :class:`ExportFailureLog` on every export logger (replacing an earlier one)."""
    flt = ExportFailureLog(target, interval_s)
    for name in EXPORT_LOGGERS:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, ExportFailureLog)]:
            logger.removeFilter(old)
        logger.addFilter(flt)
    return flt
