"""A small discrete-event simulation of serving, driven through the real telemetry API with a
virtual clock: demo traces for the notebook and docs, and load for the overhead benchmark.

Nothing runs a model: a FIFO continuous batcher admits requests under ``max_batch``, a step costs
``step_base_s + step_per_token_s * tokens``, every row samples one token per step. The API-process
side (root SERVER span, frontend stages) and the worker side (stages, :class:`EngineTelemetry`)
share one tracer here, but exchange only a traceparent string, as across LitServe's processes.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from opentelemetry import trace

from inferflow.config.tracing import TracingConfig, TracingExporter
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.plan import ExecutorOutput, SampledToken, ScheduledChunk, SchedulerOutput
from inferflow.scheduling.updates import SchedulerStats
from inferflow.telemetry.engine_telemetry import EngineTelemetry
from inferflow.telemetry.metrics import EngineMetrics
from inferflow.telemetry.setup import get_tracer, setup_tracing, shutdown_tracing
from inferflow.telemetry.spans import RequestSpan, emit_span, start_request_span
from inferflow.telemetry.timings import RequestTimings


@dataclass
class SimRequest:
    request_id: str
    arrival: float  # HTTP arrival (virtual clock)
    prompt_len: int
    max_tokens: int
    root: RequestSpan | None = None
    generated: int = 0
    timings: RequestTimings | None = None


@dataclass
class SimConfig:
    num_requests: int = 8
    seed: int = 0
    mean_interarrival_s: float = 0.004
    max_batch: int = 4
    prompt_len: tuple[int, int] = (8, 64)
    max_tokens: tuple[int, int] = (2, 12)
    step_base_s: float = 0.002
    step_per_token_s: float = 0.00005
    model: str = "tiny-llama"
    start_time: float = field(default_factory=time.time)


def _make_requests(cfg: SimConfig) -> list[SimRequest]:
    rng = random.Random(cfg.seed)
    t, out = cfg.start_time, []
    for i in range(cfg.num_requests):
        t += rng.expovariate(1.0 / cfg.mean_interarrival_s)
        out.append(
            SimRequest(f"req-{i}", t, rng.randint(*cfg.prompt_len), rng.randint(*cfg.max_tokens))
        )
    return out


def _frontend(
    tracer: trace.Tracer, telemetry: EngineTelemetry, req: SimRequest, cfg: SimConfig
) -> float:
    """API process: root span; worker: validator + tokenizer, then engine arrival (returned)."""
    req.root = start_request_span(
        tracer,
        operation="text_completion",
        model=cfg.model,
        request_id=req.request_id,
        max_tokens=req.max_tokens,
        temperature=0.0,
        start_time=req.arrival,
    )
    tp, t = req.root.traceparent, req.arrival + 0.0003  # HTTP parsing + hop to the worker
    for stage, cost in (("validator", 0.00005), ("tokenizer", 0.0002 + 0.000005 * req.prompt_len)):
        emit_span(tracer, stage, parent=tp, start_time=t, end_time=t + cost)
        t += cost
    telemetry.on_request_arrived(
        req.request_id,
        num_prompt_tokens=req.prompt_len,
        trace_context=tp,
        arrival_time=t,
        max_tokens=req.max_tokens,
    )
    return t


def _chunk(req: SimRequest, slot: int) -> ScheduledChunk:
    n = req.prompt_len if req.generated == 0 else 1
    return ScheduledChunk(
        request_id=req.request_id,
        slot=slot,
        token_ids=tuple(range(n)),
        start_pos=0 if req.generated == 0 else req.prompt_len + req.generated - 1,
        sample=True,
        sampling_params=SamplingParams(max_tokens=req.max_tokens, temperature=0.0),
        num_output_tokens=req.generated,
    )


def _scheduler_stats(num_running: int, num_waiting: int, step_id: int) -> SchedulerStats:
    """Simulated scheduler counters: 4 KV blocks per running request out of 64, no prefix hits."""
    used = 4 * num_running
    return SchedulerStats(
        num_running=num_running,
        num_waiting=num_waiting,
        num_kv_blocks_total=64,
        num_kv_blocks_used=used,
        num_kv_blocks_free=64 - used,
        num_kv_blocks_cached=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_steps=step_id + 1,
        num_scheduled_tokens=0,
    )


def _finish(telemetry: EngineTelemetry, req: SimRequest, t: float) -> None:
    rt = telemetry.request_trace(req.request_id)
    if rt is not None:  # incremental detokenization ran after every step; coalesced into one span
        rt.record_stage("detokenizer", t, t + 0.00002 * req.generated)
    reason = "length" if req.generated >= req.max_tokens else "stop"
    req.timings = telemetry.on_request_finished(
        req.request_id, reason, finish_time=t + 0.00002 * req.generated
    )
    assert (
        req.root is not None and req.timings is not None and req.timings.finished_time is not None
    )
    req.root.set_response(
        finish_reasons=[reason], input_tokens=req.prompt_len, output_tokens=req.generated
    )
    req.root.set_timings(req.timings)
    req.root.end(req.timings.finished_time + 0.0003)  # hop back + response encoding


def simulate(tracer: trace.Tracer, telemetry: EngineTelemetry, cfg: SimConfig) -> list[SimRequest]:
    """Run the simulation to completion; returns the requests with their timings."""
    pending = _make_requests(cfg)
    waiting: list[tuple[float, SimRequest]] = []  # (engine arrival, request)
    running: list[SimRequest] = []
    done: list[SimRequest] = []
    t, step_id = cfg.start_time, 0
    while pending or waiting or running:
        while pending and (pending[0].arrival <= t or not (waiting or running)):
            req = pending.pop(0)
            waiting.append((_frontend(tracer, telemetry, req, cfg), req))
            t = max(t, req.arrival)
        ready = [w for w in waiting if w[0] <= t]
        if not running and not ready:
            t = min(w[0] for w in waiting)
            continue
        while ready and len(running) < cfg.max_batch:
            item = ready.pop(0)
            waiting.remove(item)
            running.append(item[1])
        chunks = tuple(_chunk(r, slot) for slot, r in enumerate(running))
        plan = SchedulerOutput(chunks=chunks, step_id=step_id)
        end = t + cfg.step_base_s + cfg.step_per_token_s * plan.num_batched_tokens
        out = ExecutorOutput(sampled={c.request_id: SampledToken(0) for c in chunks})
        for r in running:
            r.generated += 1
        finished = [r for r in running if r.generated >= r.max_tokens]
        running = [r for r in running if r.generated < r.max_tokens]
        stats = _scheduler_stats(len(running), len(waiting), step_id)
        telemetry.on_step(plan, out, start_time=t, end_time=end, scheduler=stats)
        for r in finished:
            _finish(telemetry, r, end)
            done.append(r)
        t, step_id = end, step_id + 1
    return done


def write_demo_trace(path: str | Path, cfg: SimConfig | None = None) -> list[SimRequest]:
    """Simulate ``cfg`` (default: 8 requests) with the ``file`` exporter writing to ``path``."""
    provider = setup_tracing(
        TracingConfig(exporter=TracingExporter.file, file_path=str(path)), {"service.version": "demo"}
    )
    try:
        telemetry = EngineTelemetry(get_tracer(provider), EngineMetrics((cfg or SimConfig()).model))
        return simulate(get_tracer(provider), telemetry, cfg or SimConfig())
    finally:
        shutdown_tracing(provider)
