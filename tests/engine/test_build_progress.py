"""``BuildProgress`` on a fake clock: quiet for a short build, then a line per tenth (or a bar).

The reporter reads the clock once at its start and once per tensor; the tests set the fake
clock's time before each read, so no test sleeps or depends on the machine's speed.
"""

from __future__ import annotations

import io
import logging
import re

import pytest

from inferflow.runtimes.build_progress import BuildProgress

LOGGER = "inferflow.runtimes.build_progress"
MIB = 1 << 20


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def build(progress: BuildProgress, clock: FakeClock, times: list[float], end: float) -> None:
    """One 1 MiB tensor read at each of ``times``, then the build closes at ``end``."""
    for i, t in enumerate(times):
        clock.now = t
        progress.tensor_read(f"layers.{i}.weight", MIB)
    clock.now = end
    progress.close()


def info_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]


def test_a_build_under_two_seconds_shows_nothing(caplog: pytest.LogCaptureFixture) -> None:
    clock, stream = FakeClock(), io.StringIO()
    progress = BuildProgress("building tiny", 10 * MIB, 10, clock=clock, stream=stream)
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        build(progress, clock, [0.19 * (i + 1) for i in range(10)], end=1.95)
    assert info_lines(caplog) == []
    # the closing line still exists, at DEBUG, for whoever asks for it
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]
    assert "done, 10 tensors" in caplog.records[0].getMessage()


def test_a_slow_build_logs_at_once_then_every_tenth(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = BuildProgress("building big", 20 * MIB, 20, clock=clock, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        # 0.25 s per tensor: the quiet period ends at the 8th tensor (40 %, t = 2.0 s)
        build(progress, clock, [0.25 * (i + 1) for i in range(20)], end=5.5)
    lines = info_lines(caplog)
    percents = [int(m.group(1)) for line in lines if (m := re.search(r": (\d+)% \(", line))]
    assert percents == [40, 50, 60, 70, 80, 90, 100]
    assert "(8 of 20 tensors, 8.0 MiB of 20.0 MiB read) after 2.0 s" in lines[0]
    assert len(lines) == len(percents) + 1
    assert "done, 20 tensors (20.0 MiB read) in 5.5 s" in lines[-1]


def test_many_small_tensors_still_log_once_per_tenth(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = BuildProgress("building", 1000 * MIB, 1000, clock=clock, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        build(progress, clock, [3.0 + i / 100 for i in range(1000)], end=14.0)
    percents = [
        int(m.group(1)) for line in info_lines(caplog) if (m := re.search(r": (\d+)% \(", line))
    ]
    assert percents == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100]


def test_on_a_terminal_a_bar_appears_after_two_seconds(caplog: pytest.LogCaptureFixture) -> None:
    clock, terminal = FakeClock(), Terminal()
    progress = BuildProgress("building big", 20 * MIB, 20, clock=clock, stream=terminal)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for i in range(8):
            clock.now = 0.25 * i  # up to 1.75 s: quiet
            progress.tensor_read(f"t{i}", MIB)
        assert terminal.getvalue() == ""
        build(progress, clock, [2.0 + 0.25 * i for i in range(12)], end=5.5)
    assert "building big" in terminal.getvalue()  # the bar, drawn on the terminal stream
    lines = info_lines(caplog)
    assert len(lines) == 1 and "done, 20 tensors" in lines[0]  # no percentage lines beside it
