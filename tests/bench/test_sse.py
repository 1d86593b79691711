"""The SSE decoder: events survive any split of the byte stream."""

from __future__ import annotations

import pytest

from inferflow.bench.sse import SSEDecoder, SSEEvent

STREAM = (
    b": keep-alive ping\n\n"
    b'data: {"a": 1}\n\n'
    b"event: error\r\ndata: line one\r\ndata: line two\r\n\r\n"
    b"data:no-space\r\rdata: caf\xc3\xa9\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent('{"a": 1}'),
    SSEEvent("line one\nline two", event="error"),
    SSEEvent("no-space"),
    SSEEvent("café"),
    SSEEvent("[DONE]"),
]


def decode(pieces: list[bytes]) -> list[SSEEvent]:
    decoder = SSEDecoder()
    events = []
    for piece in pieces:
        events += decoder.feed(piece)
    return events + decoder.flush()


def test_whole_stream() -> None:
    assert decode([STREAM]) == EXPECTED


@pytest.mark.parametrize("cut", range(1, len(STREAM)))
def test_every_two_way_split(cut: int) -> None:
    # Includes cuts inside "\r\n", inside the UTF-8 "é" and inside "data:".
    assert decode([STREAM[:cut], STREAM[cut:]]) == EXPECTED


def test_byte_by_byte() -> None:
    assert decode([bytes([b]) for b in STREAM]) == EXPECTED


def test_events_dispatch_as_soon_as_their_blank_line_arrives() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: x\n") == []
    assert decoder.feed(b"\n") == [SSEEvent("x")]
    # A trailing "\r" may be the first half of "\r\n": the blank line is only known when the
    # next byte arrives (or the stream ends).
    assert decoder.feed(b"data: y\r\r") == []
    assert decoder.feed(b"data: z\n\n") == [SSEEvent("y"), SSEEvent("z")]
    assert decoder.feed(b"data: w\r\r") == []
    assert decoder.flush() == [SSEEvent("w")]


def test_flush_delivers_an_unterminated_last_event() -> None:
    decoder = SSEDecoder()
    assert decoder.feed(b"data: [DONE]") == []
    assert decoder.flush() == [SSEEvent("[DONE]")]


def test_comment_only_and_empty_blocks_dispatch_nothing() -> None:
    assert decode([b":ping\n\n\n\nevent: x\n\n"]) == []
