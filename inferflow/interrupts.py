"""Signals that stop a run: :class:`Interrupted` and :func:`signal_raises`.

Shared by the command line (a sweep stops at SIGINT or SIGTERM: no later job starts) and
``inferflow tune`` (its server being measured is stopped, its trials so far are written)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class Interrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM) stopped a run: the whole sweep stops, exit code 128 + signal.

    A KeyboardInterrupt, so that Hydra's launcher lets it through instead of starting the next
    job (it records an ``Exception`` as that job's failure and goes on)."""

    def __init__(self, sig: int = signal.SIGINT) -> None:
        super().__init__(signal.Signals(sig).name)
        self.signal = sig


def signal_of(exc: KeyboardInterrupt) -> int:
    """The signal behind an interrupt: SIGINT for a plain Ctrl+C."""
    return exc.signal if isinstance(exc, Interrupted) else signal.SIGINT


@contextlib.contextmanager
def signal_raises(sig: int) -> Iterator[None]:
    """While inside: ``sig`` raises :class:`Interrupted` (main thread only; else nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise Interrupted(signum)

    previous = signal.signal(sig, interrupt)
    try:
        yield
    finally:
        signal.signal(sig, previous)
