"""Stream classification and the per-request timings, on a scripted clock (exact)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from inferflow.bench.client import fill_record
from inferflow.bench.records import RequestRecord
from inferflow.bench.stream import StreamResult, consume_stream


class ScriptedStream:
    """Yields byte pieces; the clock reads the arrival time scripted for the current piece."""

    def __init__(self, pieces: list[tuple[float, bytes]], end_time: float | None = None) -> None:
        self.pieces = pieces
        self.now = 0.0
        self.end_time = end_time if end_time is not None else (pieces[-1][0] if pieces else 0.0)

    def clock(self) -> float:
        return self.now

    async def chunks(self) -> AsyncIterator[bytes]:
        for t, piece in self.pieces:
            self.now = t
            yield piece
        self.now = self.end_time


def data(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


def text_chunk(text: str, finish: str | None = None) -> bytes:
    return data({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def chat_chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    return data({"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})


USAGE = data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
DONE = b"data: [DONE]\n\n"


def run(stream: ScriptedStream) -> StreamResult:
    return asyncio.run(consume_stream(stream.chunks(), stream.clock))


def timed_record(stream: ScriptedStream, start: float = 10.0) -> RequestRecord:
    record = RequestRecord(
        request_id="r",
        traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
        prompt_len=99,
        start_time=start,
    )
    fill_record(record, run(stream))
    return record


def test_completions_timings_follow_content_chunks_only() -> None:
    stream = ScriptedStream(
        [
            (10.25, text_chunk("")),  # empty text: not content, no TTFT
            (10.50, text_chunk("Hello")),
            (10.60, text_chunk(" big")),
            (10.90, text_chunk(" world", finish="length")),
            (12.00, USAGE),  # a late usage chunk does not extend E2EL
            (12.10, DONE),
        ]
    )
    record = timed_record(stream)
    assert record.success and record.error == ""
    assert record.ttft == pytest.approx(0.50)
    assert record.itl == pytest.approx([0.10, 0.30])
    assert record.latency == pytest.approx(0.90)
    assert record.output_tokens == 3 and record.output_tokens_source == "usage"
    assert record.prompt_len == 7  # server-reported prompt tokens win
    assert record.generated_text == "Hello big world"
    assert record.finish_reason == "length"


def test_chat_role_and_finish_chunks_are_not_content() -> None:
    stream = ScriptedStream(
        [
            (10.01, chat_chunk({"role": "assistant", "content": ""})),
            (10.40, chat_chunk({"content": "A"})),
            (10.45, chat_chunk({"reasoning_content": "thinking"})),
            (10.70, chat_chunk({"content": "B"})),
            (10.95, chat_chunk({}, finish="stop")),
            (11.00, DONE),
        ]
    )
    record = timed_record(stream)
    assert record.ttft == pytest.approx(0.40)
    assert record.itl == pytest.approx([0.05, 0.25])
    assert record.latency == pytest.approx(0.70)
    # No usage chunk: output tokens are the counted content chunks.
    assert record.output_tokens == 3 and record.output_tokens_source == "chunks"
    assert record.prompt_len == 99


def test_events_completed_by_one_read_share_its_stamp() -> None:
    stream = ScriptedStream(
        [
            (10.2, text_chunk("a") + text_chunk("b")[:10]),
            (10.5, text_chunk("b")[10:] + text_chunk("c", finish="length") + DONE),
        ]
    )
    record = timed_record(stream)
    assert record.ttft == pytest.approx(0.2)
    assert record.itl == pytest.approx([0.3, 0.0])


@pytest.mark.parametrize(
    ("tail", "message"),
    [
        (b'event: error\ndata: {"message": "boom"}\n\n', "SSE error event"),
        (data({"error": {"message": "out of memory", "code": 500}}), "out of memory"),
        (b"data: {not json\n\n", "malformed"),
        (b"", "ended before completion"),
    ],
)
def test_streams_ending_in_an_error_fail_with_the_error(tail: bytes, message: str) -> None:
    stream = ScriptedStream([(10.1, text_chunk("a")), (10.2, text_chunk("b")), (10.3, tail)])
    record = timed_record(stream)
    assert not record.success
    assert message in record.error
    assert record.generated_text == "ab"  # what arrived before the error is kept


def test_a_stream_that_stops_reading_at_the_error() -> None:
    stream = ScriptedStream(
        [
            (10.1, data({"error": "first"}) + text_chunk("never counted", finish="stop") + DONE),
        ]
    )
    result = run(stream)
    assert "first" in result.error and result.content_times == [] and not result.done


def test_finished_stream_without_content_has_no_ttft_and_fails() -> None:
    stream = ScriptedStream([(10.1, text_chunk("", finish="stop")), (10.2, DONE)])
    record = timed_record(stream)
    assert not record.success and "without any content" in record.error


def test_done_without_blank_line_and_finish_reason_alone_both_complete() -> None:
    assert run(ScriptedStream([(1.0, text_chunk("x")), (1.1, b"data: [DONE]")])).ok
    assert run(ScriptedStream([(1.0, text_chunk("x", finish="stop"))])).ok


def test_continuous_usage_takes_the_last_report() -> None:
    pieces = [
        (1.0, data({"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}})),
        (1.1, data({"choices": [{"text": "b"}], "usage": {"completion_tokens": 2}})),
        (1.2, DONE),
    ]
    assert run(ScriptedStream(pieces)).usage_completion_tokens == 2
