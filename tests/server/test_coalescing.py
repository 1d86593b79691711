"""Token coalescing: a slow transport gets fewer, merged messages; nothing is lost or reordered."""

from __future__ import annotations

import asyncio
import threading

import pytest

from inferflow.server.http.channels import RequestChannel
from inferflow.server.messages import ErrorInfo, LogprobEntry, RequestUpdate, UpdateBatch
from inferflow.server.worker.queues import Outbox

WAIT_S = 30.0


class GatedTransport:
    """``send`` blocks until the test opens the gate, like a Manager put under load."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, UpdateBatch]] = []
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.done = threading.Condition()

    def send(self, item: UpdateBatch, consumer_id: int) -> None:
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        with self.done:
            self.sent.append((consumer_id, item))
            self.done.notify_all()


def lp(token: str, value: float) -> LogprobEntry:
    return LogprobEntry(token, 0, value)


def test_updates_posted_during_a_slow_send_are_merged_into_one_message() -> None:
    transport = GatedTransport()
    outbox = Outbox(transport)  # type: ignore[arg-type]
    outbox.start()
    outbox.post(0, RequestUpdate("a", text="He", completion_tokens=1, logprobs=(lp("He", -1.0),)))
    assert transport.entered.wait(WAIT_S)  # the sender is now stuck in the first send
    outbox.post(0, RequestUpdate("a", text="ll", completion_tokens=2, logprobs=(lp("ll", -2.0),)))
    outbox.post(1, RequestUpdate("b", text="x", completion_tokens=1))
    outbox.post(
        0,
        RequestUpdate(
            "a", text="o", completion_tokens=3, finish_reason="length", logprobs=(lp("o", -3.0),)
        ),
    )
    transport.gate.set()
    outbox.close()
    assert [c for c, _ in transport.sent] == [0, 0, 1]
    first, merged = transport.sent[0][1].updates, transport.sent[1][1].updates
    assert [u.text for u in first] == ["He"]
    assert len(merged) == 1  # two steps of "a" travelled as one update
    update = merged[0]
    assert (update.text, update.completion_tokens, update.finish_reason) == ("llo", 3, "length")
    assert [e.token for e in update.logprobs] == ["ll", "o"]
    assert transport.sent[2][1].updates[0].text == "x"


def test_close_flushes_pending_updates() -> None:
    transport = GatedTransport()
    transport.gate.set()
    outbox = Outbox(transport)  # type: ignore[arg-type]
    outbox.start()
    for i in range(50):
        outbox.post(0, RequestUpdate("r", text=str(i % 10), completion_tokens=i + 1))
    outbox.close()
    text = "".join(u.text for _, batch in transport.sent for u in batch.updates)
    assert text == "".join(str(i % 10) for i in range(50))


def test_a_lagging_reader_gets_every_queued_update_merged() -> None:
    async def scenario() -> RequestUpdate:
        channel = RequestChannel("r")
        for i, piece in enumerate(["a", "b", "c"]):
            channel.push(RequestUpdate("r", text=piece, completion_tokens=i + 1))
        return await channel.next(timeout=1.0)

    merged = asyncio.run(scenario())
    assert (merged.text, merged.completion_tokens) == ("abc", 3)


def test_the_first_final_update_closes_the_channel() -> None:
    async def scenario() -> list[RequestUpdate]:
        channel = RequestChannel("r")
        channel.push(RequestUpdate("r", text="a", finish_reason="stop"))
        channel.fail(ErrorInfo(500, "late"))  # ignored: the request already finished
        first = await channel.next(timeout=1.0)
        assert channel.worker_done
        return [first]

    (only,) = asyncio.run(scenario())
    assert only.finish_reason == "stop" and only.error is None


def test_cancelling_a_reader_is_never_swallowed_by_a_racing_update() -> None:
    """A disconnect cancels the stream's reader while updates keep arriving; the cancellation
    must win, or the stream would run to its last token (asyncio.wait_for on 3.11 loses it)."""

    async def scenario() -> bool:
        channel = RequestChannel("r")
        reader = asyncio.ensure_future(channel.next(timeout=30.0))
        await asyncio.sleep(0)  # the reader now waits on the channel
        channel.push(RequestUpdate("r", text="late"))  # wakes it...
        reader.cancel()  # ...in the same loop iteration as the cancellation
        try:
            await reader
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(scenario())


def test_a_reader_times_out_when_nothing_arrives() -> None:
    async def scenario() -> None:
        await RequestChannel("r").next(timeout=0.01)

    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(scenario())
