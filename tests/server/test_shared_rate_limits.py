"""Rate limits hold for the whole server, not per API process: the buckets live in shared memory
created before the API processes fork."""

from __future__ import annotations

import multiprocessing as mp

import httpx
import pytest
from server_harness import MODEL, start_server

from inferflow.server.http.errors import OpenAIError
from inferflow.server.http.limits import RateLimiter

pytestmark = [pytest.mark.server, pytest.mark.slow]

LIMIT = 6


def _spend(limiter: RateLimiter, attempts: int, results: mp.Queue) -> None:
    admitted = 0
    for _ in range(attempts):
        try:
            limiter.check_request("key-0")
            admitted += 1
        except OpenAIError:
            pass
    results.put(admitted)


def test_forked_processes_spend_from_one_bucket() -> None:
    limiter = RateLimiter(30, None, key_ids=["key-0"])
    ctx = mp.get_context("fork")
    results: mp.Queue = ctx.Queue()
    processes = [ctx.Process(target=_spend, args=(limiter, 40, results)) for _ in range(3)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(30)
    admitted = sum(results.get(timeout=5) for _ in processes)
    assert 30 <= admitted <= 31  # one more may have refilled (0.5 per second) meanwhile


def test_two_api_processes_admit_the_configured_rate_not_twice_it(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    srv = start_server(
        tmp_path_factory,
        "shared-limits",
        ["server.num_api_servers=2", f"server.rate_limit_requests_per_minute={LIMIT}"],
    )
    try:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
        statuses = []
        for _ in range(4 * LIMIT):  # a new connection each: both API processes take some
            with httpx.Client(timeout=30) as client:
                statuses.append(client.post(srv.url("/v1/completions"), json=body).status_code)
    finally:
        srv.terminate()
    assert set(statuses) <= {200, 429}
    # the bucket refills at LIMIT/60 per second: at most one more in the few seconds this takes
    assert LIMIT <= statuses.count(200) <= LIMIT + 1
