"""Benchmark metrics with vLLM ``bench serve`` definitions and result-JSON keys.

Per successful request (``RequestRecord``): TTFT = send → first content chunk; ITL = every gap
between consecutive content chunks; E2EL = send → last content chunk; TPOT = (E2EL - TTFT) /
(output_tokens - 1), only for requests with more than one output token (a request with one token
counts as TPOT 0 for goodput, as in vLLM). Aggregates: mean, median, population std and the
selected percentiles (numpy linear interpolation) in milliseconds, keyed
``{mean,median,std}_{metric}_ms`` and ``p{P}_{metric}_ms`` (P printed without ".0").
Throughputs divide by the run's wall time ``duration``; goodput counts successful requests that
meet every SLO given (``value <= slo``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from inferflow.bench.records import RequestRecord

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
GOODPUT_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class LatencySamples:
    """Per-metric samples (seconds) collected from the successful records."""

    ttft: list[float]
    tpot: list[float]  # requests with > 1 output token only
    itl: list[float]  # every gap of every request
    e2el: list[float]
    tpot_for_goodput: list[float]  # one per successful request, 0 when output_tokens <= 1

    def of(self, name: str) -> list[float]:
        return list(getattr(self, name))


def collect_samples(records: Sequence[RequestRecord]) -> LatencySamples:
    ttft: list[float] = []
    tpot: list[float] = []
    itl: list[float] = []
    e2el: list[float] = []
    tpot_all: list[float] = []
    for record in records:
        if not record.success:
            continue
        value = 0.0
        if record.output_tokens > 1:
            value = (record.latency - record.ttft) / (record.output_tokens - 1)
            tpot.append(value)
        tpot_all.append(value)
        ttft.append(record.ttft)
        itl.extend(record.itl)
        e2el.append(record.latency)
    return LatencySamples(ttft, tpot, itl, e2el, tpot_all)


def percentile_key(p: float, metric: str) -> str:
    """``p99_ttft_ms`` for 99, ``p99.9_ttft_ms`` for 99.9 (vLLM's spelling)."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def summarize(
    values: Sequence[float], metric: str, percentiles: Sequence[float]
) -> dict[str, float]:
    """Mean/median/std/percentiles of ``values`` (seconds) in ms; all 0 when empty (vLLM)."""
    data = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{metric}_ms": float(np.mean(data)),
        f"median_{metric}_ms": float(np.median(data)),
        f"std_{metric}_ms": float(np.std(data)),
    }
    for p in percentiles:
        out[percentile_key(p, metric)] = float(np.percentile(data, p))
    return out


def count_good(samples: LatencySamples, goodput: dict[str, float]) -> int:
    """Successful requests meeting every SLO in ``goodput`` (metric name → limit in ms)."""
    columns = {"ttft": samples.ttft, "tpot": samples.tpot_for_goodput, "e2el": samples.e2el}
    chosen = [(columns[name], limit / 1000.0) for name, limit in goodput.items()]
    return sum(
        all(values[i] <= limit for values, limit in chosen) for i in range(len(samples.ttft))
    )


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most successful requests in flight at once, over half-open intervals [start, end)."""
    events: list[tuple[float, int]] = []
    for r in records:
        if r.success:
            events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    events.sort()  # at equal times, -1 sorts before +1: a departure frees its slot first
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_chunks_per_s(records: Sequence[RequestRecord]) -> float:
    """Most content chunks received within one 1-second bucket of the run (vLLM's
    ``max_output_tokens_per_s``, which also counts chunks, not tokens)."""
    ok = [r for r in records if r.success]
    if not ok:
        return 0.0
    t0 = min(r.start_time for r in ok)
    stamps = [np.cumsum([r.start_time + r.ttft, *r.itl]) for r in ok]
    buckets = np.floor(np.concatenate(stamps) - t0).astype(np.int64)
    return float(np.bincount(buckets).max())


def compute_metrics(
    records: Sequence[RequestRecord],
    duration: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    goodput: dict[str, float] | None = None,
    metrics: Sequence[str] = METRIC_NAMES,
) -> dict[str, float | None]:
    """All aggregate figures of one run, keyed as in vLLM's result JSON."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    unknown = set(goodput or {}) - set(GOODPUT_NAMES)
    if unknown:
        raise ValueError(f"goodput metrics must be among {GOODPUT_NAMES}, got {sorted(unknown)}")
    ok = [r for r in records if r.success]
    samples = collect_samples(records)
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_tokens for r in ok)
    result: dict[str, float | None] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "request_goodput": count_good(samples, goodput) / duration if goodput else None,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        # the busiest second is never below the run's mean (coalesced chunks carry several
        # tokens, so a count of chunks alone can be)
        "max_output_tokens_per_s": max(peak_output_chunks_per_s(records), total_output / duration),
        "max_concurrent_requests": peak_concurrency(records),
    }
    for name in metrics:
        if name not in METRIC_NAMES:
            raise ValueError(f"percentile metrics must be among {METRIC_NAMES}, got {name!r}")
        result.update(summarize(samples.of(name), name, percentiles))
    return result


def detailed_fields(records: Sequence[RequestRecord]) -> dict[str, list[object]]:
    """Per-request arrays (vLLM ``--save-detailed`` names, plus ids for joining server traces)."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.client_queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
        "request_ids": [r.request_id for r in records],
        "traceparents": [r.traceparent for r in records],
        "trace_ids": [r.trace_id for r in records],
        "http_statuses": [r.http_status for r in records],
        "output_tokens_sources": [r.output_tokens_source for r in records],
    }
