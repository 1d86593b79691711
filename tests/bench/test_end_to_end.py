"""The generator against a simulated server with planted delays (real HTTP on 127.0.0.1).

Two kinds of checks. Causal bounds hold on any machine: the server sleeps before each chunk, so a
client figure can never be below the planted value. Upper bounds use a generous slack so that a
busy 2-core machine does not fail them, yet a unit mistake (s vs ms), a wrong chunk (role chunk
taken as the first token, usage chunk taken as the last) or a wrong divisor would.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest

from inferflow.bench.client import EndpointSpec
from inferflow.bench.datasets import DatasetConfig, build_dataset
from inferflow.bench.metrics import compute_metrics
from inferflow.bench.records import SampleRequest
from inferflow.bench.runner import LoadConfig, RunOutput, run_load
from inferflow.bench.text import WordTextSource
from inferflow.testing.fake_server import FakeServer

TTFT, DELAY, TOKENS = 0.05, 0.02, 6
EPS = 1e-3  # clock granularity
SLACK = 0.5  # seconds of scheduling noise tolerated above a planted value

Factory = Callable[..., FakeServer]


def run(
    server: FakeServer, samples: list[SampleRequest], chat: bool = False, **load: object
) -> RunOutput:
    path = "/v1/chat/completions" if chat else "/v1/completions"
    spec = EndpointSpec(server.url + path, "fake-model", chat=chat, ignore_eos=True)
    return asyncio.run(run_load(spec, samples, LoadConfig(disable_tqdm=True, **load)))  # type: ignore[arg-type]


def samples(n: int, tokens: int = TOKENS) -> list[SampleRequest]:
    return [SampleRequest(f"prompt number {i}", 3, tokens) for i in range(n)]


@pytest.mark.parametrize("chat", [False, True])
def test_planted_ttft_tpot_itl_and_throughput_are_measured(
    fake_server: Factory, chat: bool
) -> None:
    server = fake_server(ttft_s=TTFT, token_delay_s=DELAY)
    out = run(server, samples(4), chat=chat)
    m = compute_metrics(out.records, out.duration, percentiles=[99])
    assert (m["completed"], m["failed"]) == (4, 0)
    assert m["total_output_tokens"] == 4 * TOKENS
    planted_e2el = TTFT + (TOKENS - 1) * DELAY
    for r in out.records:
        assert r.output_tokens_source == "usage" and len(r.itl) == TOKENS - 1
        # Causal: the server slept TTFT before the first content chunk (the chat role chunk is
        # sent at once and must not count), and the whole planted time before the last one.
        assert r.ttft >= TTFT - EPS and r.latency >= planted_e2el - EPS
        assert r.ttft <= TTFT + SLACK
    for seen in server.received:  # the server's own clock (same process) agrees
        record = next(r for r in out.records if r.request_id == seen.headers["x-request-id"])
        assert record.ttft >= seen.sent_at[0] - seen.received_at - EPS
    assert DELAY / 2 <= m["median_itl_ms"] / 1000 <= DELAY + SLACK / 5
    assert DELAY / 2 <= m["mean_tpot_ms"] / 1000 <= DELAY + SLACK / 5
    assert TTFT - EPS <= m["median_ttft_ms"] / 1000 <= TTFT + SLACK
    # All at once: the run lasts at least one request's planted time, so throughput is capped.
    assert out.duration >= planted_e2el - EPS
    assert m["request_throughput"] <= 4 / planted_e2el + EPS
    assert m["request_throughput"] >= 4 / (planted_e2el + SLACK)
    assert m["output_throughput"] * out.duration == pytest.approx(4 * TOKENS)


def test_error_streams_fail_and_keep_their_error(fake_server: Factory, tmp_path: Path) -> None:
    server = fake_server(ttft_s=0.02, token_delay_s=0.01)
    prompts = [
        "ok one",
        "[[error-event]]",
        "[[error-data]]",
        "[[truncate]]",
        "[[http-500]]",
        "ok two",
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": p, "output_len": 4}) for p in prompts))
    reqs = build_dataset(DatasetConfig(name="jsonl", path=str(path)), WordTextSource())
    out = run(server, reqs)
    by_prompt = dict(zip(prompts, out.records, strict=True))
    assert [r.success for r in out.records] == [True, False, False, False, False, True]
    assert "SSE error event" in by_prompt["[[error-event]]"].error
    assert "planted failure" in by_prompt["[[error-data]]"].error
    assert "ended before completion" in by_prompt["[[truncate]]"].error
    assert by_prompt["[[http-500]]"].http_status == 500
    assert "planted HTTP 500" in by_prompt["[[http-500]]"].error
    m = compute_metrics(out.records, out.duration)
    assert (m["completed"], m["failed"]) == (2, 4)
    assert m["total_output_tokens"] == 8  # failed requests add no tokens


def test_without_usage_support_output_tokens_are_counted_chunks(fake_server: Factory) -> None:
    server = fake_server(ttft_s=0.01, token_delay_s=0.005, support_usage=False)
    out = run(server, samples(2, tokens=5))
    assert [(r.output_tokens, r.output_tokens_source) for r in out.records] == [(5, "chunks")] * 2


def test_max_concurrency_caps_requests_in_flight(fake_server: Factory) -> None:
    server = fake_server(ttft_s=0.03, token_delay_s=0.01)
    out = run(server, samples(6, tokens=4), max_concurrency=2)
    assert server.peak_active <= 2
    m = compute_metrics(out.records, out.duration)
    assert m["completed"] == 6 and m["max_concurrent_requests"] <= 2
    # Four requests had to wait for a slot, and a slot frees only after a whole request.
    waited = [
        r.client_queue_time for r in out.records if r.client_queue_time >= 0.03 + 3 * 0.01 - EPS
    ]
    assert len(waited) >= 4


def test_request_rate_spaces_the_sends(fake_server: Factory) -> None:
    server = fake_server(ttft_s=0.005, token_delay_s=0.001)
    out = run(server, samples(4, tokens=2), request_rate=20.0, burstiness=math.inf)
    # Evenly spaced at 20 req/s: release i at (i + 1) * 50 ms, and a release is never early.
    for i, r in enumerate(out.records):
        assert r.start_time - out.start >= 0.05 * (i + 1) - EPS
    assert out.duration >= 0.2 - EPS


def test_trace_headers_reach_the_server_and_the_records(fake_server: Factory) -> None:
    server = fake_server(ttft_s=0.01, token_delay_s=0.005)
    out = run(server, samples(3, tokens=2), request_id_prefix="run7-")
    sent = {s.headers["x-request-id"]: s.headers["traceparent"] for s in server.received}
    assert sent == {r.request_id: r.traceparent for r in out.records}
    assert sorted(sent) == ["run7-0", "run7-1", "run7-2"]
    assert len({r.trace_id for r in out.records}) == 3


def test_warmups_are_sent_but_not_measured(fake_server: Factory) -> None:
    server = fake_server(ttft_s=0.005, token_delay_s=0.001)
    out = run(server, samples(2, tokens=2), num_warmups=3)
    assert len(out.records) == 2
    ids = [s.headers["x-request-id"] for s in server.received]
    assert sum("warmup" in i for i in ids) == 3 and len(ids) == 5


def test_unreachable_server_fails_every_request() -> None:
    spec = EndpointSpec("http://127.0.0.1:9/v1/completions", "m")
    out = asyncio.run(run_load(spec, samples(2), LoadConfig(disable_tqdm=True, timeout_s=5)))
    assert all(not r.success and "ConnectError" in r.error for r in out.records)
