"""Running one load: release requests on schedule, cap concurrency, collect the records.

The run's wall time (``duration``) starts just before the first release and ends when the last
request finished; throughputs divide by it. A request's ``start_time`` is taken after it passed
the concurrency semaphore (the wait is ``client_queue_time``), so TTFT and E2EL measure the
server, not the client's own queue — as in vLLM.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import math
import time
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from inferflow.bench.arrivals import arrival_offsets
from inferflow.bench.client import EndpointSpec, send_request
from inferflow.bench.records import RequestRecord, SampleRequest


@dataclass(frozen=True)
class LoadConfig:
    """How requests are released: rate (req/s, ``inf`` = all at once), burstiness, cap."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    request_id_prefix: str = "bench-"
    num_warmups: int = 0
    timeout_s: float = 6 * 3600.0
    disable_tqdm: bool = False

    def validate(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_warmups < 0:
            raise ValueError(f"num_warmups must be >= 0, got {self.num_warmups}")


@dataclass
class RunOutput:
    records: list[RequestRecord]  # in send order
    duration: float  # seconds, wall time of the measured part of the run
    start: float = 0.0  # perf_counter at the start of the run (offsets count from here)


def make_client(load: LoadConfig) -> httpx.AsyncClient:
    """No connection limit: a pooled wait inside httpx would hide client queueing in TTFT."""
    keepalive = load.max_concurrency or 100
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=keepalive)
    timeout = httpx.Timeout(load.timeout_s, connect=min(load.timeout_s, 60.0))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def run_load(spec: EndpointSpec, samples: list[SampleRequest], load: LoadConfig) -> RunOutput:
    """Send every sample on the arrival schedule and wait for all of them."""
    load.validate()
    offsets = arrival_offsets(len(samples), load.request_rate, load.burstiness, load.seed)
    semaphore = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    async with make_client(load) as client:
        if load.num_warmups:
            await _warmup(client, spec, samples[0], load, semaphore)
        bar = tqdm(total=len(samples), disable=load.disable_tqdm, desc="requests")
        start = time.perf_counter()
        tasks = []
        for i, (sample, offset) in enumerate(zip(samples, offsets, strict=True)):
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            request_id = f"{load.request_id_prefix}{i}"
            tasks.append(
                asyncio.create_task(_one(client, spec, sample, request_id, semaphore, bar))
            )
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        bar.close()
    return RunOutput(records, duration, start)


def run_load_sync(spec: EndpointSpec, samples: list[SampleRequest], load: LoadConfig) -> RunOutput:
    """:func:`run_load` from synchronous code, including code that already runs inside an event
    loop (a Jupyter cell): then the load runs on its own loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_load(spec, samples, load))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, run_load(spec, samples, load)).result()


async def _one(
    client: httpx.AsyncClient,
    spec: EndpointSpec,
    sample: SampleRequest,
    request_id: str,
    semaphore: asyncio.Semaphore | None,
    bar: tqdm | None,
) -> RequestRecord:
    released = time.perf_counter()
    async with semaphore or contextlib.nullcontext():
        record = await send_request(client, spec, sample, request_id)
    record.client_queue_time = record.start_time - released
    if bar is not None:
        bar.update(1)
    return record


async def _warmup(
    client: httpx.AsyncClient,
    spec: EndpointSpec,
    sample: SampleRequest,
    load: LoadConfig,
    semaphore: asyncio.Semaphore | None,
) -> None:
    """Unmeasured requests (copies of the first sample) before the clock starts."""
    ids = [f"{load.request_id_prefix}warmup-{i}" for i in range(load.num_warmups)]
    await asyncio.gather(*(_one(client, spec, sample, rid, semaphore, None) for rid in ids))
