"""The Ray host's batched update transport (``inferflow.server.ray.transport``) on real ZeroMQ
sockets over TCP on 127.0.0.1, without Ray: what an engine replica sends an ingress replica.

- one ``UpdateBatch`` is one message, delivered whole and in order;
- a message not signed with the app's key is dropped unread (the port is reachable from the
  node's network; the receiver unpickles nothing it cannot verify);
- ``ReplyTransport`` (the engine replica's ``Outbox`` sink) sends each batch to its ingress
  replica as one message and reports the requests whose final update it carried.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import pickle
import threading
import time

import pytest
import zmq

from inferflow.server.messages import ErrorInfo, RequestUpdate, UpdateBatch
from inferflow.server.ray.transport import UpdateReceiver, UpdateSender, new_key

pytest.importorskip(
    "ray.serve", reason='the Ray host needs the ray extra: pip install "inferflow[ray]"'
)


def _batch(*ids: str, final: bool = False) -> UpdateBatch:
    return UpdateBatch(
        tuple(RequestUpdate(i, text=f"<{i}>", finish_reason="stop" if final else None) for i in ids)
    )


async def _receive(
    key: bytes, send: object, expected: int, timeout: float = 10.0
) -> list[UpdateBatch]:
    """Start a receiver, run ``send(address)`` in a thread, collect ``expected`` batches."""
    got: list[UpdateBatch] = []
    done = asyncio.Event()

    def on_batch(batch: UpdateBatch) -> None:
        got.append(batch)
        if len(got) >= expected:
            done.set()

    receiver = UpdateReceiver(key, "127.0.0.1")
    address = receiver.start(on_batch)
    try:
        thread = threading.Thread(target=send, args=(address,))  # type: ignore[arg-type]
        thread.start()
        await asyncio.wait_for(done.wait(), timeout)
        await asyncio.sleep(0.2)  # nothing more arrives
        thread.join(5)
    finally:
        receiver.close()
    return got


def test_batches_arrive_whole_and_in_order_and_unsigned_ones_are_dropped() -> None:
    key = bytes.fromhex(new_key())
    sender = UpdateSender(key)

    def send(address: str) -> None:
        sender.send(address, _batch("a", "b"))
        # a stranger: the right shape, the wrong key; then garbage that is not even pickle
        rogue = zmq.Context.instance().socket(zmq.PUSH)
        rogue.connect(address)
        body = pickle.dumps(_batch("evil"))
        rogue.send_multipart([hmac.new(b"guess", body, hashlib.sha256).digest(), body])
        rogue.send_multipart([b"x", b"not pickle"])
        rogue.send(b"one frame")
        rogue.close(linger=1000)
        time.sleep(0.2)
        sender.send(address, _batch("c", final=True))

    got = asyncio.run(_receive(key, send, expected=2))
    sender.close()
    assert [[u.request_id for u in b.updates] for b in got] == [["a", "b"], ["c"]]
    assert got[1].updates[0].final and got[0].updates[1].text == "<b>"


def test_reply_transport_sends_each_batch_as_one_message_and_reports_finals() -> None:
    from inferflow.server.ray.engine_replica import ReplyTransport

    key = bytes.fromhex(new_key())
    finals: list[list[str]] = []

    def send(address: str) -> None:
        transport = ReplyTransport(UpdateSender(key), 0.2, finals.append)
        consumer = transport.consumer(address)
        assert transport.consumer(address) == consumer  # one id per ingress address
        for batch in (_batch("a"), _batch("a", "b"), _batch("b", final=True)):
            transport.send(batch, consumer)
        transport.send(RequestUpdate("ignored"), consumer)  # not a batch: nothing sent
        transport.sender.close()

    got = asyncio.run(_receive(key, send, expected=3))
    assert [[u.request_id for u in b.updates] for b in got] == [["a"], ["a", "b"], ["b"]]
    assert finals == [["b"]]


def test_pacing_spares_a_requests_first_and_last_update(monkeypatch: pytest.MonkeyPatch) -> None:
    """Within the interval, a message waits for it, unless it carries a request's first update
    (TTFT is not paced) or a final one; no clock is asserted: the waits are recorded."""
    from inferflow.server.ray import engine_replica
    from inferflow.server.ray.engine_replica import ReplyTransport

    waits: list[float] = []
    monkeypatch.setattr(engine_replica.time, "sleep", waits.append)
    sent: list[list[str]] = []

    class Sender:
        def send(self, address: str, item: UpdateBatch) -> None:
            sent.append([u.request_id for u in item.updates])

    transport = ReplyTransport(Sender(), 3600.0, lambda ids: None)  # type: ignore[arg-type]
    consumer = transport.consumer("tcp://127.0.0.1:1")
    transport.send(_batch("a"), consumer)  # a's first token: at once
    assert waits == []
    transport.send(_batch("a", "b"), consumer)  # b's first token rides along: at once
    assert waits == []
    transport.send(_batch("a"), consumer)  # a's next tokens: paced
    assert len(waits) == 1 and waits[0] > 0
    transport.send(_batch("b", final=True), consumer)  # b ends: at once
    transport.send(_batch("b"), consumer)  # a new request reusing the id starts again: at once
    assert len(waits) == 1 and len(sent) == 5


def test_an_error_update_survives_the_trip() -> None:
    key = bytes.fromhex(new_key())
    sender = UpdateSender(key)
    lost = ErrorInfo(503, "the engine replica serving this request was lost", code="replica_lost")

    def send(address: str) -> None:
        sender.send(address, UpdateBatch((RequestUpdate("r", error=lost),)))

    (batch,) = asyncio.run(_receive(key, send, expected=1))
    sender.close()
    assert batch.updates[0].error == lost and batch.updates[0].final
