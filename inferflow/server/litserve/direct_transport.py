"""Updates from the engine workers straight to the API processes: ZeroMQ PUSH -> PULL over
Unix-domain (``ipc://``) sockets, one PULL socket per API process.

LitServe's default transport (``MPQueueTransport``) puts every message into a Manager queue:
the worker pickles it to the Manager process, and the API process fetches it back with a
blocking proxy call in a thread (a second pickle, a thread hop per message). Each engine step's
``UpdateBatch`` thus crossed two process boundaries and kept the Manager process busy, CPU that
lands on ONNX Runtime's critical path on a 2-core machine (docs/performance.md). Here a message
is one pickle and one socket write from the worker's sender thread, read by the API process's
event loop directly.

Why PUSH/PULL and not LitServe's own ZMQ transport: that one is PUB/SUB through a broker
process, and PUB drops messages past its high-water mark; a PUSH socket never drops (it would
block the sender, whose ``Outbox`` keeps merging updates meanwhile), and its queue is unbounded
here, as the Manager queue was. A killed worker holds no lock that anyone else waits for (a
``multiprocessing.Queue`` would leave its write lock taken).

Lifecycle: the main process creates the transport (a private folder for the socket files)
before it forks the API processes and spawns the workers; it pickles as that folder alone.
Sockets are made lazily where they are used: an API process binds its PULL socket on its first
``areceive``; every sending thread (a worker's sender, the main process's ``WorkerLost``
notices) connects its own PUSH sockets, so no ZeroMQ socket is shared between threads or
inherited across a fork. A PUSH that connects before the PULL is bound keeps its messages until
the PULL appears. Messages from one sending thread arrive in the order sent.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import pickle
import shutil
import tempfile
import threading
from typing import Any

import zmq
import zmq.asyncio
from litserve.transport.base import MessageTransport

RECEIVE_POLL_S = 1.0  # areceive without a timeout answers None after this long (as LitServe's)
FLUSH_AT_EXIT_MS = 2000  # how long an exiting process may take to hand over what it sent

# Every PUSH socket this process made (by any thread), so the messages still queued in them are
# written before the process exits: a worker's last updates (errors for the requests it fails
# while stopping) are sent just before it exits.
_push_sockets: list[zmq.Socket] = []
_push_lock = threading.Lock()
_push_pid = os.getpid()


def _flush_at_exit() -> None:
    """At interpreter exit (spawned workers, the main process): close this process's PUSH
    sockets with a linger and terminate the context, which returns once they are written (or
    after ``FLUSH_AT_EXIT_MS``). Forked API processes leave through ``os._exit``: they only
    receive."""
    with _push_lock:
        if _push_pid != os.getpid() or not _push_sockets:
            return
        for sock in _push_sockets:
            sock.close(linger=FLUSH_AT_EXIT_MS)
        _push_sockets.clear()
    zmq.Context.instance().term()


atexit.register(_flush_at_exit)


def _register(sock: zmq.Socket) -> None:
    global _push_pid
    with _push_lock:
        if _push_pid != os.getpid():  # a forked child: the parent's sockets are not ours
            _push_pid = os.getpid()
            _push_sockets.clear()
        _push_sockets.append(sock)


class DirectTransport(MessageTransport):
    """Worker -> API process messages for ``num_consumers`` API processes (consumer ids
    ``0 .. num_consumers - 1``); ``folder`` holds the socket files (made when ``None``)."""

    def __init__(self, num_consumers: int, folder: str | None = None) -> None:
        if num_consumers < 1:
            raise ValueError("a transport needs at least one consumer")
        self.num_consumers = num_consumers
        # the process that made the folder removes it (not the API processes forked from it)
        self._owner_pid = os.getpid() if folder is None else None
        self.folder = folder or tempfile.mkdtemp(prefix="inferflow-ipc-")
        self._local = threading.local()  # this thread's PUSH sockets (and their process id)
        self._pull: zmq.asyncio.Socket | None = None
        self._pull_key: tuple[int, int] | None = None  # (process id, consumer id) it serves
        self._closed = False

    def __reduce__(self) -> tuple[Any, ...]:
        return DirectTransport, (self.num_consumers, self.folder)

    def address(self, consumer_id: int) -> str:
        if not 0 <= consumer_id < self.num_consumers:
            raise ValueError(f"consumer id {consumer_id} is not in [0, {self.num_consumers})")
        return f"ipc://{self.folder}/consumer-{consumer_id}"

    # --- sending (any thread of any process) ---------------------------------------------------
    def send(self, item: Any, consumer_id: int) -> None:
        if self._closed:
            raise OSError("the transport is closed")
        data = pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._push(consumer_id).send(data)  # copied: the process may exit before it is written
        except zmq.ZMQError as exc:  # the callers handle OSError (the Manager queue's errors)
            raise OSError(f"cannot send to API process {consumer_id}: {exc}") from exc

    def _push(self, consumer_id: int) -> zmq.Socket:
        """This thread's PUSH socket to ``consumer_id`` (made on first use)."""
        local = self._local
        if getattr(local, "pid", None) != os.getpid():  # first use here, or inherited by a fork
            local.pid, local.sockets = os.getpid(), {}
        sock = local.sockets.get(consumer_id)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)  # unbounded, as the Manager queue was: never drops
            sock.connect(self.address(consumer_id))
            local.sockets[consumer_id] = sock
            _register(sock)
        return sock

    # --- receiving (the API process's event loop) ----------------------------------------------
    async def areceive(self, consumer_id: int, timeout: float | None = None) -> Any:  # type: ignore[override]
        """The next message for ``consumer_id``, or ``None`` after ``timeout`` seconds
        (``RECEIVE_POLL_S`` when ``None``)."""
        if self._closed:
            raise asyncio.CancelledError("transport closed")
        pull = self._pull_socket(consumer_id)
        wait_ms = int(1000 * (RECEIVE_POLL_S if timeout is None else timeout))
        if not await pull.poll(wait_ms):  # POLLIN
            return None
        return pickle.loads(await pull.recv(copy=True))

    def _pull_socket(self, consumer_id: int) -> zmq.asyncio.Socket:
        key = (os.getpid(), consumer_id)
        if self._pull is None or self._pull_key != key:
            sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(self.address(consumer_id))
            self._pull, self._pull_key = sock, key
        return self._pull

    # --- shutdown ----------------------------------------------------------------------------
    def close(self, **kwargs: Any) -> None:
        """Stop sending and receiving in this process and close its receiving socket; the
        process that made the folder also removes it (the main process, once every child is
        gone). Sending sockets are flushed and closed at exit (``_flush_at_exit``). LitServe's
        ``send_sentinel`` has no counterpart here: a receiver stops when its task is cancelled."""
        self._closed = True
        if (
            self._pull is not None
            and self._pull_key is not None
            and self._pull_key[0] == os.getpid()
        ):
            self._pull.close()
        self._pull = None
        if self._owner_pid == os.getpid():
            with contextlib.suppress(OSError):
                shutil.rmtree(self.folder)
