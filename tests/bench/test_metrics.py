"""The metric math on hand-built records: exact values computed by hand (vLLM definitions)."""

from __future__ import annotations

import math
import statistics

import pytest

from inferflow.bench.metrics import (
    compute_metrics,
    detailed_fields,
    peak_concurrency,
    peak_output_chunks_per_s,
    percentile_key,
)
from inferflow.bench.records import RequestRecord

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def rec(start: float, ttft: float, itl: list[float], tokens: int, prompt_len: int) -> RequestRecord:
    return RequestRecord(
        request_id=f"r{start}",
        traceparent=TP,
        prompt_len=prompt_len,
        success=True,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
        output_tokens=tokens,
    )


def records() -> list[RequestRecord]:
    a = rec(0.00, 0.1, [0.02, 0.04], tokens=3, prompt_len=10)  # TPOT (0.16-0.1)/2 = 30 ms
    b = rec(0.10, 0.3, [0.05] * 4, tokens=5, prompt_len=20)  # TPOT 0.2/4 = 50 ms
    c = rec(0.16, 0.2, [], tokens=1, prompt_len=30)  # one token: no TPOT sample
    d = RequestRecord(request_id="d", traceparent=TP, prompt_len=40, error="HTTP 500: x")
    return [a, b, c, d]


def test_counts_and_throughputs_use_successful_requests_over_wall_time() -> None:
    m = compute_metrics(records(), duration=2.0)
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["duration"] == 2.0
    assert m["request_goodput"] is None  # no SLOs given


def test_latency_statistics_in_ms() -> None:
    m = compute_metrics(records(), duration=2.0, percentiles=[90, 99])
    # TTFT samples 100, 300, 200 ms (the failed request contributes nothing).
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))  # population std, as numpy
    assert m["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation at rank 1.8
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT samples 30 and 50 ms.
    assert (m["mean_tpot_ms"], m["median_tpot_ms"]) == pytest.approx((40.0, 40.0))
    assert m["std_tpot_ms"] == pytest.approx(10.0)
    assert m["p90_tpot_ms"] == pytest.approx(48.0)
    # ITL: every gap of every request: 20, 40, 50, 50, 50, 50 ms.
    assert m["mean_itl_ms"] == pytest.approx(260 / 6)
    assert m["median_itl_ms"] == pytest.approx(50.0)
    # E2EL: 160, 500, 200 ms.
    assert m["mean_e2el_ms"] == pytest.approx(statistics.mean([160, 500, 200]))
    assert m["median_e2el_ms"] == pytest.approx(200.0)
    assert m["std_e2el_ms"] == pytest.approx(statistics.pstdev([160, 500, 200]))


def test_goodput_counts_requests_meeting_every_slo() -> None:
    rs = records()
    # A (100 ms, 30 ms) and C (200 ms, TPOT 0 for a one-token output) meet both.
    assert compute_metrics(rs, 2.0, goodput={"ttft": 250, "tpot": 40})["request_goodput"] == 1.0
    # Limits are inclusive: A meets ttft:100 tpot:30 exactly; C misses TTFT.
    assert compute_metrics(rs, 2.0, goodput={"ttft": 100, "tpot": 30})["request_goodput"] == 0.5
    assert compute_metrics(rs, 2.0, goodput={"e2el": 150})["request_goodput"] == 0.0
    assert compute_metrics(rs, 2.0, goodput={"e2el": 500})["request_goodput"] == 1.5


def test_percentile_keys_match_vllm_spelling() -> None:
    assert percentile_key(99, "ttft") == "p99_ttft_ms"
    assert percentile_key(99.9, "itl") == "p99.9_itl_ms"
    m = compute_metrics(records(), 2.0, percentiles=[50, 99.9], metrics=["ttft"])
    assert {"p50_ttft_ms", "p99.9_ttft_ms", "mean_ttft_ms"} <= m.keys()
    assert "mean_tpot_ms" not in m  # only the selected metrics are reported


def test_vllm_result_keys_are_present() -> None:
    m = compute_metrics(records(), 2.0)
    expected = {
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
        "max_output_tokens_per_s",
        "max_concurrent_requests",
    }
    for metric in ("ttft", "tpot", "itl", "e2el"):
        expected |= {f"{s}_{metric}_ms" for s in ("mean", "median", "std", "p90", "p99")}
    assert expected <= m.keys()


def test_all_failed_gives_zero_latencies_not_nan() -> None:
    failed = [RequestRecord(request_id="x", traceparent=TP, prompt_len=5, error="boom")]
    m = compute_metrics(failed, 1.0)
    assert m["completed"] == 0 and m["failed"] == 1
    assert m["mean_ttft_ms"] == 0.0 and m["p99_itl_ms"] == 0.0 and m["total_input_tokens"] == 0


def test_peak_concurrency_uses_half_open_intervals() -> None:
    # A [0, .16), B [.1, .6), C [.16, .36): C starts when A ends, so at most two overlap.
    assert peak_concurrency(records()) == 2
    back_to_back = [rec(0.0, 0.5, [], 1, 1), rec(0.5, 0.5, [], 1, 1)]
    assert peak_concurrency(back_to_back) == 1


def test_peak_output_chunks_per_second_buckets_chunk_arrivals() -> None:
    assert peak_output_chunks_per_s(records()) == 9.0  # every chunk lands in second 0
    spread = [rec(0.0, 0.5, [0.3, 0.3, 0.3], 4, 1)]  # chunks at 0.5, 0.8 | 1.1, 1.4
    assert peak_output_chunks_per_s(spread) == 2.0


def test_invalid_inputs_are_rejected() -> None:
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(records(), 0.0)
    with pytest.raises(ValueError, match="goodput"):
        compute_metrics(records(), 1.0, goodput={"itl": 5})
    with pytest.raises(ValueError, match="percentile metrics"):
        compute_metrics(records(), 1.0, metrics=["latency"])


def test_detailed_fields_carry_ids_to_join_server_traces() -> None:
    d = detailed_fields(records())
    assert d["trace_ids"] == ["0af7651916cd43dd8448eb211c80319c"] * 4
    assert d["traceparents"][0] == TP
    assert d["output_lens"] == [3, 5, 1, 0]
    assert d["errors"][3] == "HTTP 500: x"
    assert len({len(v) for v in d.values()}) == 1  # one entry per request in every array
