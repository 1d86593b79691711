"""A request's engine-side timestamps, the latencies derived from them, and the HTTP timing
headers the frontend puts on a response.

The worker process fills a :class:`RequestTimings` (through
:class:`~inferflow.telemetry.request_trace.RequestTrace`) and sends ``to_dict()`` back with the
response; the API process rebuilds it with ``from_dict()`` and calls :func:`timing_headers`.
"""

from __future__ import annotations

from dataclasses import dataclass

from inferflow.outputs import RequestMetrics
from inferflow.telemetry import attributes as A

QUEUE_TIME_HEADER = "x-inferflow-queue-time-ms"
INFERENCE_TIME_HEADER = "x-inferflow-inference-time-ms"
TTFT_HEADER = "x-inferflow-time-to-first-token-ms"
SERVER_TIMING_HEADER = "server-timing"


@dataclass(frozen=True)
class RequestTimings:
    """Wall-clock timestamps (``time.time()`` seconds) of one request inside the engine.

    Invariant when set: ``arrival <= first_scheduled <= prefill_end <= finished`` and
    ``first_scheduled <= first_token <= last_token <= finished``. ``arrival`` is when the engine
    accepted the request (``add_request``): stages before it (validator, tokenizer) are not queue.
    A request aborted while waiting has ``first_scheduled_time is None``: all of it was queue.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prefill_end_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        """arrival -> first scheduled (or -> finished when never scheduled)."""
        end = (
            self.first_scheduled_time
            if self.first_scheduled_time is not None
            else self.finished_time
        )
        return None if end is None else end - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """first scheduled -> prefill end (the step that sampled the first token)."""
        if self.first_scheduled_time is None:
            return None
        end = self.prefill_end_time if self.prefill_end_time is not None else self.finished_time
        return None if end is None else end - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """prefill end -> finished."""
        if self.prefill_end_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.prefill_end_time

    @property
    def inference_time(self) -> float | None:
        """first scheduled -> finished: compute time (prefill + decode)."""
        if self.first_scheduled_time is None or self.finished_time is None:
            return None
        return self.finished_time - self.first_scheduled_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """(last token - first token) / (output tokens - 1), vLLM's TPOT; None below 2 tokens."""
        if self.num_output_tokens < 2 or self.first_token_time is None:
            return None
        last = self.last_token_time if self.last_token_time is not None else self.finished_time
        return (
            None if last is None else (last - self.first_token_time) / (self.num_output_tokens - 1)
        )

    def latency_attributes(self) -> dict[str, float]:
        """vLLM-style ``gen_ai.latency.*`` span attributes (seconds), only those known."""
        values = {
            A.LATENCY_TIME_IN_QUEUE: self.queue_time,
            A.LATENCY_TIME_TO_FIRST_TOKEN: self.time_to_first_token,
            A.LATENCY_TIME_IN_MODEL_PREFILL: self.prefill_time,
            A.LATENCY_TIME_IN_MODEL_DECODE: self.decode_time,
            A.LATENCY_TIME_IN_MODEL_INFERENCE: self.inference_time,
            A.LATENCY_E2E: self.e2e_latency,
        }
        return {k: v for k, v in values.items() if v is not None}

    @classmethod
    def from_metrics(cls, metrics: RequestMetrics, num_output_tokens: int) -> RequestTimings:
        """From the engine's :class:`RequestMetrics` (prefill ends with the first token)."""
        return cls(
            arrival_time=metrics.arrival_time,
            first_scheduled_time=metrics.first_scheduled_time,
            first_token_time=metrics.first_token_time,
            prefill_end_time=metrics.first_token_time,
            last_token_time=metrics.last_token_time,
            finished_time=metrics.finished_time,
            num_output_tokens=num_output_tokens,
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000.0:.3f}"


def timing_headers(timings: RequestTimings) -> dict[str, str]:
    """Response headers separating queue time from inference (compute) time.

    ``x-inferflow-queue-time-ms``, ``x-inferflow-inference-time-ms``,
    ``x-inferflow-time-to-first-token-ms`` and a W3C ``server-timing`` header
    (``queue;dur=..., prefill;dur=..., decode;dur=..., inference;dur=..., e2e;dur=...``, in ms).
    Missing phases (e.g. a request aborted in the queue has no prefill) are omitted. Only usable on
    non-streaming responses: a streamed response's headers leave before the timings exist.
    """
    return phase_timing_headers(
        queue_time_s=timings.queue_time,
        inference_time_s=timings.inference_time,
        time_to_first_token_s=timings.time_to_first_token,
        prefill_time_s=timings.prefill_time,
        decode_time_s=timings.decode_time,
        e2e_s=timings.e2e_latency,
    )


def phase_timing_headers(
    *,
    queue_time_s: float | None,
    inference_time_s: float | None,
    time_to_first_token_s: float | None = None,
    prefill_time_s: float | None = None,
    decode_time_s: float | None = None,
    e2e_s: float | None = None,
) -> dict[str, str]:
    """:func:`timing_headers` from bare phase durations (seconds; None = unknown, omitted)."""
    known = {
        QUEUE_TIME_HEADER: queue_time_s,
        INFERENCE_TIME_HEADER: inference_time_s,
        TTFT_HEADER: time_to_first_token_s,
    }
    headers = {name: _ms(value) for name, value in known.items() if value is not None}
    phases = (
        ("queue", queue_time_s),
        ("prefill", prefill_time_s),
        ("decode", decode_time_s),
        ("inference", inference_time_s),
        ("e2e", e2e_s),
    )
    parts = [f"{metric};dur={_ms(value)}" for metric, value in phases if value is not None]
    if parts:
        headers[SERVER_TIMING_HEADER] = ", ".join(parts)
    return headers
