"""Progress of an engine build, tensor by tensor, and the memory it used.

On a terminal a progress bar over the checkpoint bytes read; otherwise (a server's log, CI) a
log line at every tenth of them. Either way one closing line says how long the build took and
the process's peak RSS (its high-water mark: the build's own where the caller reset it at the
build's start, as the engine cache does, which also writes it to the manifest).
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferflow.models.checkpoint import ModelWeights

log = logging.getLogger(__name__)


def _size(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / (1 << 20):.1f} MiB"


def reset_peak_rss() -> None:
    """Start the process's RSS high-water mark again from its current RSS (Linux: writing 5 to
    /proc/self/clear_refs), so ``peak_rss_bytes`` then measures what follows. ``ru_maxrss`` cannot
    be reset, and a spawned worker even starts with its parent's."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])  # kB
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark: VmHWM (since the last ``reset_peak_rss``), or
    ``ru_maxrss`` where /proc is missing (KiB on Linux, bytes on macOS)."""
    kib = _status_kib("VmHWM")
    if kib is not None:
        return kib * 1024
    maxrss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def current_rss_bytes() -> int:
    """The process's RSS now (0 where /proc is missing)."""
    return (_status_kib("VmRSS") or 0) * 1024


class BuildProgress:
    """Counts tensors and bytes read; ``tensor_read`` is ``ModelWeights.on_read``."""

    def __init__(self, label: str, total_bytes: int, num_tensors: int) -> None:
        self.label, self.total_bytes, self.num_tensors = label, max(total_bytes, 1), num_tensors
        self.tensors = self.bytes_read = 0
        self._started = time.perf_counter()
        self._next_log = 0.1  # fraction of the bytes at which the next log line is written
        self._bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, desc=label, unit="B", unit_scale=True,
                             unit_divisor=1024, file=sys.stderr, leave=False)

    @classmethod
    def of(cls, weights: ModelWeights, label: str) -> BuildProgress:
        """Progress over every read of ``weights`` (the tied embedding counts twice)."""
        reads = len(weights.tensor_names) + int(weights.config.tie_word_embeddings)
        progress = cls(label, weights.read_bytes, reads)
        weights.on_read = progress.tensor_read
        return progress

    def tensor_read(self, name: str, nbytes: int) -> None:
        self.tensors += 1
        self.bytes_read += nbytes
        if self._bar is not None:
            self._bar.set_postfix_str(name, refresh=False)
            self._bar.update(nbytes)
            return
        done = self.bytes_read / self.total_bytes
        if done >= self._next_log:
            self._next_log = (int(done * 10) + 1) / 10
            log.info("%s: %d%% (%d of %d tensors, %s of %s read) after %.1f s", self.label,
                     round(done * 100), self.tensors, self.num_tensors, _size(self.bytes_read),
                     _size(self.total_bytes), time.perf_counter() - self._started)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s: done, %d tensors (%s read) in %.1f s, peak RSS %s", self.label,
                 self.tensors, _size(self.bytes_read), time.perf_counter() - self._started,
                 _size(peak_rss_bytes()))

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
