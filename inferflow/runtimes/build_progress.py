"""Progress of an engine build, tensor by tensor, and the memory it used.

On a terminal a progress bar over the checkpoint bytes read; otherwise (a server's log, CI) a
log line at every tenth of them. Either way one closing line says how long the build took and
the build's peak RSS (the process's high-water mark, reset when the build starts), which the
engine cache also writes to the manifest.
"""

from __future__ import annotations

import logging
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferflow.models.checkpoint import ModelWeights

log = logging.getLogger(__name__)

GiB = float(1 << 30)


def reset_peak_rss() -> None:
    """Start the process's RSS high-water mark again from its current RSS (Linux: writing 5 to
    /proc/self/clear_refs), so ``peak_rss_bytes`` then measures what follows. ``ru_maxrss`` cannot
    be reset, and a spawned worker even starts with its parent's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark: VmHWM (since the last ``reset_peak_rss``), or
    ``ru_maxrss`` where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class BuildProgress:
    """Counts tensors and bytes read; ``tensor_read`` is ``ModelWeights.on_read``."""

    def __init__(self, label: str, total_bytes: int, num_tensors: int) -> None:
        self.label, self.total_bytes, self.num_tensors = label, max(total_bytes, 1), num_tensors
        self.tensors = self.bytes_read = 0
        self._started = time.perf_counter()
        self._next_log = 0.1  # fraction of the bytes at which the next log line is written
        self._bar: Any = None
        reset_peak_rss()  # the closing line's peak is this build's
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
            log.info("%s: %d%% (%d of %d tensors, %.2f of %.2f GiB read) after %.1f s", self.label,
                     round(done * 100), self.tensors, self.num_tensors, self.bytes_read / GiB,
                     self.total_bytes / GiB, time.perf_counter() - self._started)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        log.info("%s: done, %d tensors (%.2f GiB read) in %.1f s, peak RSS %.2f GiB", self.label,
                 self.tensors, self.bytes_read / GiB, time.perf_counter() - self._started,
                 peak_rss_bytes() / GiB)

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
