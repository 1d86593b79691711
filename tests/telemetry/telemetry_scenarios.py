"""A two-request serving story driven through the real telemetry API, split as LitServe splits
it: the API-process side (root SERVER spans) and the worker side (stages, engine steps), which
exchange only W3C carrier dicts and timing dicts — so the worker side can run in another process.

Engine timeline (seconds after ``base``; tokens are sampled at a step's end)::

    r1 arrives 0.010   r2 arrives 0.012
    step 0  0.015-0.020  r1 prefill (5 tokens)            -> r1 token 1
    step 1  0.021-0.026  r1 decode, r2 prefill (7 tokens) -> r1 token 2, r2 token 1
    step 2  0.027-0.030  r1 decode, r2 decode             -> r1 token 3 (length), r2 token 2
            r1 detokenizer 0.030-0.0305, r1 finished 0.0305
    step 3  0.031-0.034  r2 decode                        -> r2 token 3, r2 finished (stop) 0.034
"""

from __future__ import annotations

from opentelemetry import trace

from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.plan import ExecutorOutput, SampledToken, ScheduledChunk, SchedulerOutput
from inferflow.scheduling.updates import SchedulerStats
from inferflow.telemetry import (
    EngineMetrics,
    EngineTelemetry,
    RequestSpan,
    RequestTimings,
    TracingConfig,
    get_tracer,
    make_stage_wrapper,
    resource_attributes,
    setup_tracing,
    shutdown_tracing,
    start_request_span,
)

CLIENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
CLIENT_TRACEPARENT = f"00-{CLIENT_TRACE_ID:032x}-{CLIENT_SPAN_ID:016x}-01"
PROMPT_LEN = {"r1": 5, "r2": 7}
MAX_TOKENS = {"r1": 3, "r2": 8}
ARRIVAL = {"r1": 0.010, "r2": 0.012}
FINISH = {"r1": (0.0305, "length"), "r2": (0.034, "stop")}
ROOT_END = {"r1": 0.032, "r2": 0.036}
# expected engine phases (s): queue, prefill, decode, ttft, e2e (engine arrival -> finish)
EXPECTED = {
    "r1": {"queue": 0.005, "prefill": 0.005, "decode": 0.0105, "ttft": 0.010, "e2e": 0.0205},
    "r2": {"queue": 0.009, "prefill": 0.005, "decode": 0.008, "ttft": 0.014, "e2e": 0.022},
}
STEPS = [  # (start, end, [(request_id, num_tokens, num_output_tokens_before)])
    (0.015, 0.020, [("r1", 5, 0)]),
    (0.021, 0.026, [("r1", 1, 1), ("r2", 7, 0)]),
    (0.027, 0.030, [("r1", 1, 2), ("r2", 1, 1)]),
    (0.031, 0.034, [("r2", 1, 2)]),
]


def api_start(
    tracer: trace.Tracer, request_id: str, base: float, with_client_parent: bool
) -> RequestSpan:
    """API process: root span of one request (r1 continues the client's traceparent), then the
    request stages (validator, tokenizer) through the stage wrapper, as the server's pipeline."""
    headers = {"Traceparent": CLIENT_TRACEPARENT} if with_client_parent else {"accept": "*/*"}
    root = start_request_span(
        tracer,
        operation="chat",
        model="tiny-llama",
        headers=headers,
        request_id=request_id,
        max_tokens=MAX_TOKENS[request_id],
        temperature=0.5,
        start_time=base,
    )
    wrap = make_stage_wrapper(tracer, parent_of=lambda request: request["trace_context"])
    for stage in ("validator", "tokenizer"):
        with wrap(stage, {"trace_context": root.trace_context}):
            pass
    return root


def api_finish(root: RequestSpan, request_id: str, timings: RequestTimings, base: float) -> None:
    """API process: usage, finish reason and the worker's timings on the root span; end it."""
    reason = FINISH[request_id][1]
    root.set_response(
        finish_reasons=[reason],
        input_tokens=PROMPT_LEN[request_id],
        output_tokens=3,
        cached_input_tokens=2 if request_id == "r2" else 0,
    )
    root.set_timings(timings)
    root.end(end_time=base + ROOT_END[request_id])


def _chunk(rid: str, n: int, before: int) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=rid,
        slot=int(rid[1]),
        token_ids=tuple(range(n)),
        start_pos=0,
        sample=True,
        sampling_params=SamplingParams(max_tokens=MAX_TOKENS[rid]),
        num_output_tokens=before,
    )


def worker_side(
    telemetry: EngineTelemetry, carriers: dict[str, dict[str, str] | None], base: float
) -> dict[str, RequestTimings]:
    """Worker process: the engine timeline above, given each request's W3C carrier.
    Returns ``{request_id: RequestTimings}`` (what the worker sends back)."""
    for rid, carrier in carriers.items():
        telemetry.on_request_arrived(
            rid,
            num_prompt_tokens=PROMPT_LEN[rid],
            trace_context=carrier,
            arrival_time=base + ARRIVAL[rid],
            max_tokens=MAX_TOKENS[rid],
            operation="chat",
        )
    timings: dict[str, RequestTimings] = {}
    for step_id, (start, end, rows) in enumerate(STEPS):
        plan = SchedulerOutput(chunks=tuple(_chunk(*row) for row in rows), step_id=step_id)
        out = ExecutorOutput(sampled={rid: SampledToken(1) for rid, _, _ in rows})
        # cumulative counters, as the scheduler keeps them: r2's admission queried 7 tokens, hit 2
        stats = SchedulerStats(
            num_running=len(rows),
            num_waiting=0,
            num_kv_blocks_total=16,
            num_kv_blocks_used=len(rows),
            num_kv_blocks_free=16 - len(rows),
            num_kv_blocks_cached=0,
            prefix_cache_queries=7 if step_id >= 1 else 0,
            prefix_cache_hits=2 if step_id >= 1 else 0,
            num_preemptions=0,
            num_steps=step_id + 1,
            num_scheduled_tokens=0,
        )
        telemetry.on_step(plan, out, start_time=base + start, end_time=base + end, scheduler=stats)
        for rid, (finish, reason) in FINISH.items():
            if rid not in timings and finish <= end + 0.001:
                rt = telemetry.request_trace(rid)
                assert rt is not None
                rt.record_stage("detokenizer", base + end, base + finish)
                cached = 2 if rid == "r2" else 0
                result = telemetry.on_request_finished(
                    rid, reason, finish_time=base + finish, num_cached_tokens=cached
                )
                assert isinstance(result, RequestTimings)
                timings[rid] = result
    return timings


def otlp_config(protocol: str, endpoint: str, service_name: str = "inferflow") -> TracingConfig:
    return TracingConfig(
        exporter="otlp",
        protocol=protocol,
        endpoint=endpoint,
        headers="x-api-key=secret-key",
        service_name=service_name,
    )


def worker_process_main(protocol: str, endpoint: str, carriers: dict, base: float) -> dict:
    """Entry point of a spawned worker process: own provider and metrics, export, flush, exit."""
    provider = setup_tracing(
        otlp_config(protocol, endpoint, "inferflow-worker"),
        resource_attributes(model_name="tiny-llama", engine="onnxruntime"),
    )
    try:
        telemetry = EngineTelemetry(get_tracer(provider), EngineMetrics("tiny-llama"))
        return worker_side(telemetry, carriers, base)
    finally:
        shutdown_tracing(provider)


def metrics_worker_main(engine_index: int, base: float) -> None:
    """A spawned inference worker: the engine timeline with metrics only (no tracer)."""
    telemetry = EngineTelemetry(None, EngineMetrics("tiny-llama", engine_index))
    worker_side(telemetry, {"r1": None, "r2": None}, base)


def metrics_launcher_main(directory: str) -> str:
    """A server launcher in its own interpreter: prometheus_client is already imported (as by a
    library) when the multiprocess directory is prepared; the API-side ServerMetrics lives here,
    two spawned workers run engines. Returns the /metrics text the API process would serve."""
    import multiprocessing

    import prometheus_client  # noqa: F401  (imported before PROMETHEUS_MULTIPROC_DIR is set)

    from inferflow.telemetry import ServerMetrics, prepare_multiprocess_dir, render_metrics

    prepare_multiprocess_dir(directory)
    server = ServerMetrics("tiny-llama")
    server.on_response("/v1/chat/completions", 200, 0.05)
    ctx = multiprocessing.get_context("spawn")
    workers = [ctx.Process(target=metrics_worker_main, args=(i, 1000.0)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0, w.exitcode
    body, content_type = render_metrics(server.registry)
    assert content_type.startswith("text/plain")
    return body.decode()
