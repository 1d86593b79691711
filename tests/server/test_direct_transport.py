"""DirectTransport: worker -> API process messages over ZeroMQ PUSH/PULL, without the Manager.

Real sockets and a real second process (started as LitServe starts a worker: the transport
arrives pickled); no mocks.
"""

from __future__ import annotations

import asyncio
import pickle
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from inferflow.server.litserve.direct_transport import DirectTransport
from inferflow.server.messages import ErrorInfo, RequestUpdate, UpdateBatch

SENDER = """
import pickle, sys
from inferflow.server.messages import RequestUpdate, UpdateBatch
transport = pickle.loads(bytes.fromhex(sys.argv[1]))
for i in range(int(sys.argv[2])):
    text = str(i) + " " * 200_000  # large: still being written when the process exits
    transport.send(UpdateBatch((RequestUpdate(request_id=f"r{i}", text=text),)), consumer_id=0)
# no close, no sleep: the process exits at once, as a worker does after its last send
"""


@pytest.fixture
def transport() -> Iterator[DirectTransport]:
    t = DirectTransport(num_consumers=2)
    yield t
    t.close()


async def _receive(t: DirectTransport, consumer_id: int, count: int) -> list[object]:
    got: list[object] = []
    while len(got) < count:
        message = await t.areceive(consumer_id=consumer_id, timeout=10)
        assert message is not None, f"only {len(got)} of {count} messages arrived"
        got.append(message)
    return got


def test_a_spawned_sender_delivers_everything_in_order_even_when_it_exits_at_once(
    transport: DirectTransport,
) -> None:
    async def run() -> list[object]:
        assert await transport.areceive(consumer_id=0, timeout=0.05) is None  # binds; empty
        sender = subprocess.Popen(
            [sys.executable, "-c", SENDER, pickle.dumps(transport).hex(), "500"]
        )
        got = await _receive(transport, 0, 500)
        assert sender.wait(timeout=30) == 0
        return got

    got = asyncio.run(run())
    assert [b.updates[0].text.strip() for b in got] == [str(i) for i in range(500)]  # type: ignore[attr-defined]


def test_messages_sent_before_the_receiver_binds_are_kept(transport: DirectTransport) -> None:
    error = RequestUpdate(request_id="x", error=ErrorInfo(500, "boom", code="engine_error"))
    sent = threading.Thread(target=transport.send, args=(UpdateBatch((error,)), 1))
    sent.start()
    sent.join()

    got = asyncio.run(_receive(transport, 1, 1))
    assert got == [UpdateBatch((error,))]


def test_each_consumer_gets_only_its_own_messages(transport: DirectTransport) -> None:
    for i in range(6):
        transport.send(("for", i % 2, i), consumer_id=i % 2)

    async def run() -> tuple[list[object], list[object]]:
        second = DirectTransport(2, transport.folder)  # another API process's copy
        try:
            return await _receive(transport, 0, 3), await _receive(second, 1, 3)
        finally:
            second.close()

    zero, one = asyncio.run(run())
    assert zero == [("for", 0, 0), ("for", 0, 2), ("for", 0, 4)]
    assert one == [("for", 1, 1), ("for", 1, 3), ("for", 1, 5)]


def test_receive_times_out_with_none_and_ids_are_checked(transport: DirectTransport) -> None:
    assert asyncio.run(transport.areceive(consumer_id=0, timeout=0.05)) is None
    with pytest.raises(ValueError, match="consumer id 2"):
        transport.send("x", consumer_id=2)


def test_it_pickles_as_its_folder_and_the_owner_removes_the_folder() -> None:
    owner = DirectTransport(1)
    folder = Path(owner.folder)
    copy = pickle.loads(pickle.dumps(owner))
    assert (copy.folder, copy.num_consumers) == (owner.folder, 1)
    copy.close()
    assert folder.is_dir()  # a copy (a worker, an API process) leaves the folder alone
    owner.close()
    assert not folder.exists()
    with pytest.raises(OSError, match="closed"):
        owner.send("late", consumer_id=0)
