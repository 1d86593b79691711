"""Engine replica -> ingress replica updates, batched: one ZeroMQ message per engine flush per
ingress replica (the Ray host's ``DirectTransport``).

A streaming ``DeploymentHandle`` call per request made every streamed update its own Ray
message (a task result through the object store, the replica's event loop, the handle's
generator): on 2 cores that cost more than the engine step. Here the request still travels as a
handle call (Serve routes it, counts it for ``max_ongoing_requests`` and autoscaling, and fails
it when its replica dies), but its updates do not: the engine replica's ``Outbox`` coalesces the
updates of every request of a step by destination, and ``UpdateSender`` writes each destination
one message -- as the single-machine worker does towards its API processes.

Each ingress replica binds one PULL socket on its node's address (``UpdateReceiver``, TCP: the
engine replicas may be on other nodes) and names it in every call (``reply_to``). A PUSH socket
never drops a message (unbounded high-water mark; the sender's ``Outbox`` merges updates while
a send is slow). Every message carries an HMAC-SHA256 of its body under the app's key (made by
the host, bound into both deployments): the receiver unpickles nothing it cannot verify, since
the port is reachable from the node's network.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import pickle
import threading
from collections.abc import Callable

import zmq
import zmq.asyncio

from inferflow.server.messages import UpdateBatch

logger = logging.getLogger(__name__)

LINGER_MS = 2000  # an exiting replica may take this long to hand over its last updates


def _mac(key: bytes, body: bytes) -> bytes:
    return hmac.new(key, body, hashlib.sha256).digest()


class UpdateReceiver:
    """The ingress replica's end: ``start`` binds ``tcp://HOST:*`` and feeds every verified
    ``UpdateBatch`` to ``on_batch`` on the running event loop."""

    def __init__(self, key: bytes, host: str) -> None:
        self.key, self.host = key, host
        self.address = ""
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self, on_batch: Callable[[UpdateBatch], None]) -> str:
        sock = zmq.asyncio.Context.instance().socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        port = sock.bind_to_random_port(f"tcp://{self.host}")
        self._socket, self.address = sock, f"tcp://{self.host}:{port}"
        self._task = asyncio.get_running_loop().create_task(self._run(on_batch))
        return self.address

    async def _run(self, on_batch: Callable[[UpdateBatch], None]) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2 or not hmac.compare_digest(frames[0], _mac(self.key, frames[1])):
                logger.warning("dropped an update message that does not carry the app's key")
                continue
            batch = pickle.loads(frames[1])  # verified: from an engine replica of this app
            try:
                on_batch(batch)
            except Exception:  # one bad batch must not stop the receiver
                logger.exception("delivering an update batch failed")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class UpdateSender:
    """The engine replica's end: ``send(address, batch)`` from any thread (each thread has its
    own PUSH sockets: ZeroMQ sockets are not thread-safe)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()

    def send(self, address: str, batch: UpdateBatch) -> None:
        body = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._socket(address).send_multipart([_mac(self.key, body), body])
        except zmq.ZMQError as exc:  # (the Outbox logs OSErrors and goes on)
            raise OSError(f"cannot send updates to {address}: {exc}") from exc

    def _socket(self, address: str) -> zmq.Socket:
        sockets: dict[str, zmq.Socket] | None = getattr(self._local, "sockets", None)
        if sockets is None:
            sockets = self._local.sockets = {}
        sock = sockets.get(address)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, LINGER_MS)
            sock.connect(address)
            sockets[address] = sock
            with self._lock:
                self._sockets.append(sock)
        return sock

    def close(self) -> None:
        """Close every socket, writing what is queued (up to ``LINGER_MS``)."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(Exception):
                sock.close(linger=LINGER_MS)


def new_key() -> str:
    """A fresh app key (hex), bound into both deployments by the host."""
    import secrets

    return secrets.token_hex(32)


def node_address() -> str:
    """The address other nodes reach this process's node at (Ray's view of it)."""
    import ray

    return str(ray.util.get_node_ip_address())
