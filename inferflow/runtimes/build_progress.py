"""Progress of an engine build, tensor by tensor, and the memory it used.

A build shorter than ``BuildProgress.quiet_s`` (2 s) shows nothing: the default tiny model
builds in a fraction of a second. Past it, on a terminal a progress bar over the checkpoint bytes
read; otherwise (a server's log, CI) a log line at once, then one at every further tenth of them.
Either way one closing line says how long the build took and the process's peak RSS (its
high-water mark: the build's own where the caller reset it at the build's start, as the engine
cache does, which also writes it to the manifest); a quiet build logs it at DEBUG only.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

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
    """Counts tensors and bytes read; ``tensor_read`` is ``ModelWeights.on_read``.

    ``clock`` (seconds) and ``stream`` (where a bar goes; a terminal gets one) default to
    ``time.perf_counter`` and ``sys.stderr``; tests pass their own.
    """

    quiet_s = 2.0  # nothing is shown before the build has run this long

    def __init__(self, label: str, total_bytes: int, num_tensors: int,
                 clock: Callable[[], float] = time.perf_counter,
                 stream: TextIO | None = None) -> None:
        self.label, self.total_bytes, self.num_tensors = label, max(total_bytes, 1), num_tensors
        self.tensors = self.bytes_read = 0
        self._clock = clock
        self._started = clock()
        self._stream = sys.stderr if stream is None else stream
        self._tty = self._stream.isatty()
        self._next_log = 0.0  # fraction of the bytes at which the next log line is written
        self._bar: Any = None  # made once the quiet period is over, on a terminal only

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
        elapsed = self._clock() - self._started
        if elapsed < self.quiet_s:
            return
        if self._tty:
            self._update_bar(name, nbytes)
            return
        done = self.bytes_read / self.total_bytes
        if done >= self._next_log:  # 0 at first: a line as soon as the quiet period is over
            self._next_log = (int(done * 10) + 1) / 10
            log.info("%s: %d%% (%d of %d tensors, %s of %s read) after %.1f s", self.label,
                     round(done * 100), self.tensors, self.num_tensors, _size(self.bytes_read),
                     _size(self.total_bytes), elapsed)

    def _update_bar(self, name: str, nbytes: int) -> None:
        if self._bar is None:  # starts where the quiet period left the build
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_bytes, initial=self.bytes_read - nbytes,
                             desc=self.label, unit="B", unit_scale=True, unit_divisor=1024,
                             file=self._stream, leave=False)
        self._bar.set_postfix_str(name, refresh=False)
        self._bar.update(nbytes)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elapsed = self._clock() - self._started
        log.log(logging.INFO if elapsed >= self.quiet_s else logging.DEBUG,
                "%s: done, %d tensors (%s read) in %.1f s, peak RSS %s", self.label,
                self.tensors, _size(self.bytes_read), elapsed, _size(peak_rss_bytes()))

    def __enter__(self) -> BuildProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
