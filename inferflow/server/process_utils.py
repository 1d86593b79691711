"""Process-tree helpers: children that die with their parent, and walking a tree via /proc."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send ``sig`` to this process when its parent exits (no-op elsewhere).

    This is the safety net for a supervisor killed with SIGKILL: the Manager, the engine worker
    and the API processes then go with it instead of lingering as orphans.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def name_process(name: str) -> None:
    """Set this process's name as ``ps``/``top`` and /proc/PID/comm show it (Linux; at most 15
    bytes), so an operator can tell the queue, worker and API processes apart."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def init_queue_process(sig: int) -> None:
    """Initializer of the queue (Manager) process."""
    die_with_parent(sig)
    name_process(QUEUE_PROCESS_NAME)


QUEUE_PROCESS_NAME = "inferflow-queue"


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children, grandchildren, ...), from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(int(entry.name))
            if ppid is not None:
                parents[int(entry.name)] = ppid
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, ppid in parents.items() if ppid == parent]
        found.extend(children)
        frontier.extend(children)
    return found


def process_rss(pid: int | None) -> int:
    """Resident memory of ``pid`` in bytes (0 when it is gone or None)."""
    if pid is None or pid <= 0:
        return 0
    try:
        resident = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return 0
    return resident * os.sysconf("SC_PAGE_SIZE")
