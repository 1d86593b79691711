"""Sending one streamed request to an OpenAI-compatible server and timing it.

Every request carries ``x-request-id`` and a fresh W3C ``traceparent`` (random trace id, sampled
flag set), so a server that honours trace context puts its spans in the trace the client chose and
client-side figures can be joined with server-side traces by ``trace_id``.
"""

from __future__ import annotations

import itertools
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from inferflow.bench.records import RequestRecord, SampleRequest
from inferflow.bench.stream import StreamResult, consume_stream


@dataclass(frozen=True)
class EndpointSpec:
    """Where and how to send requests; the same for every request of a run.

    ``chat`` selects the ``/v1/chat/completions`` payload (messages) instead of ``/v1/completions``
    (prompt). ``force_output_len`` also sends ``min_tokens = max_tokens`` (vLLM extension) so that
    every request generates exactly its expected output length where the server allows it.
    ``include_usage`` asks for ``stream_options.include_usage`` so output tokens are counted by
    the server; without it (or when the server ignores it) content chunks are counted.
    """

    api_url: str
    model: str
    chat: bool = False
    ignore_eos: bool = False
    force_output_len: bool = False
    include_usage: bool = True
    extra_body: dict[str, object] = field(default_factory=dict)
    extra_headers: dict[str, str] = field(default_factory=dict)


def make_traceparent() -> str:
    """A W3C trace-context header: version 00, random trace id and parent id, sampled."""
    trace_id = secrets.token_hex(16)
    span_id = secrets.token_hex(8)
    # All-zero ids are invalid; the chance is 2**-128 but the rule costs one line.
    if int(trace_id, 16) == 0 or int(span_id, 16) == 0:
        return make_traceparent()
    return f"00-{trace_id}-{span_id}-01"


def build_payload(spec: EndpointSpec, sample: SampleRequest) -> dict[str, object]:
    """The JSON body for ``sample``: always streamed, output length as the dataset asks."""
    payload: dict[str, object] = {"model": spec.model, "stream": True}
    if spec.chat:
        payload["messages"] = sample.chat_messages()
        # Newer servers read max_completion_tokens, older ones max_tokens; send both.
        payload["max_completion_tokens"] = sample.expected_output_len
    else:
        payload["prompt"] = sample.prompt
    payload["max_tokens"] = sample.expected_output_len
    if spec.include_usage:
        payload["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        payload["ignore_eos"] = True
    if spec.force_output_len:
        payload["min_tokens"] = sample.expected_output_len
    payload.update(spec.extra_body)
    return payload


def with_api_key(headers: dict[str, str]) -> dict[str, str]:
    """The bearer token from ``OPENAI_API_KEY`` (if set), then ``headers`` (which win)."""
    key = os.environ.get("OPENAI_API_KEY")
    return {**({"Authorization": f"Bearer {key}"} if key else {}), **headers}


def build_headers(spec: EndpointSpec, request_id: str, traceparent: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    headers.update(with_api_key(spec.extra_headers))
    headers["x-request-id"] = request_id
    headers["traceparent"] = traceparent
    return headers


async def send_request(
    client: httpx.AsyncClient,
    spec: EndpointSpec,
    sample: SampleRequest,
    request_id: str,
    clock: Callable[[], float] = time.perf_counter,
) -> RequestRecord:
    """Send ``sample``, read the whole stream, and return its measurements (never raises for
    HTTP or stream failures: they become ``success=False`` with ``error`` set)."""
    record = RequestRecord(
        request_id=request_id,
        traceparent=make_traceparent(),
        prompt_len=sample.prompt_len,
        expected_output_len=sample.expected_output_len,
    )
    payload = build_payload(spec, sample)
    headers = build_headers(spec, request_id, record.traceparent)
    record.start_time = clock()
    try:
        async with client.stream("POST", spec.api_url, json=payload, headers=headers) as response:
            record.http_status = response.status_code
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                return record
            result = await consume_stream(response.aiter_bytes(), clock)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    fill_record(record, result)
    return record


def fill_record(record: RequestRecord, result: StreamResult) -> None:
    """Derive TTFT, ITLs, E2EL and the output token count from the stream's stamps."""
    record.generated_text = result.text
    record.finish_reason = result.finish_reason
    if result.usage_prompt_tokens is not None:
        record.prompt_len = result.usage_prompt_tokens
    if not result.ok:
        record.error = result.error
        return
    times = result.content_times
    record.ttft = times[0] - record.start_time
    record.itl = [later - earlier for earlier, later in itertools.pairwise(times)]
    record.latency = times[-1] - record.start_time
    if result.usage_completion_tokens is not None:
        record.output_tokens = result.usage_completion_tokens
        record.output_tokens_source = "usage"
    else:
        record.output_tokens = len(times)
        record.output_tokens_source = "chunks"
    record.success = True
