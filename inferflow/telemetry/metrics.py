"""Engine Prometheus metrics: vLLM-compatible names (``vllm:*``) alongside OpenTelemetry GenAI
server metrics (``gen_ai_server_*``) and a few inferflow-specific ones (``inferflow:*``).

Cross-process design (LitServe: the API process serves ``/metrics``, the inference worker runs
the engine): prometheus_client *multiprocess mode*. The server prepares a private directory with
:func:`inferflow.telemetry.metrics_export.prepare_multiprocess_dir` before LitServe starts its
processes; the worker's :class:`EngineMetrics` then writes its samples to per-pid files there and
the API process renders all of them with :func:`inferflow.telemetry.metrics_export.render_metrics`.
Without that directory (offline use, tests) the same object keeps values in memory and
:meth:`EngineMetrics.render` serves them. Create one EngineMetrics per process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from inferflow.scheduling.updates import SpecDecodeStats
from inferflow.telemetry.spec_decode import SpecDecodeMetrics
from inferflow.telemetry.timings import RequestTimings

# Buckets (seconds). vLLM's start at 0.3 s for request latencies; CPU-sized models need finer
# ones below, so ours extend vLLM's downwards (names are the contract, buckets are not).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0,
                           2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                           480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# OpenTelemetry GenAI semantic-convention recommended boundaries
GEN_AI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                       2.5, 5.0, 7.5, 10.0)  # fmt: skip
GEN_AI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
GEN_AI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                           20.48, 40.96, 81.92)  # fmt: skip
GUIDED_MASK_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
GUIDED_COMPILE_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

FINISH_REASONS = ("stop", "length", "abort", "error")
ENGINE_LABELS = ["model_name", "engine"]  # the labels of every vllm:* / inferflow:* series


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, and the scheduler's state after it.

    Token counts: ``num_prefill_tokens`` = prompt tokens computed this step (prefix-cache hits
    excluded), ``num_generation_tokens`` = tokens sampled this step (first tokens included).
    ``time_to_first_tokens`` holds arrival -> first token of each request whose first token
    came out this step; ``inter_token_latencies`` the gap since the previous token of every
    other request that got a token. Prefix-cache counters are in tokens, for this step only.
    """

    batch_size: int
    num_prefill_tokens: int
    num_generation_tokens: int
    num_running: int
    num_waiting: int
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    time_to_first_tokens: Sequence[float] = ()
    inter_token_latencies: Sequence[float] = ()
    guided_rows: int = 0  # rows sampled under a structured-output mask
    guided_mask_s: float = 0.0  # time the guided stage took to fill their masks
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)  # this step's drafts


@dataclass(frozen=True)
class FinishedRequestStats:
    """One finished request: its timings (the one home of its latencies; ``finished_time`` set)
    and what the metrics label or count beside them."""

    timings: RequestTimings
    finish_reason: str  # stop | length | abort | error
    num_prompt_tokens: int
    max_tokens: int | None = None
    operation: str = "text_completion"  # gen_ai.operation.name label
    guided_compile_s: float | None = None  # structured output: grammar compile (0 if cached)
    guided_cache_hit: bool | None = None


class EngineMetrics:
    """Prometheus instruments of one engine; the engine calls :meth:`on_step` after every step
    and :meth:`on_request_finished` once per finished request. Labels: ``model_name`` and
    ``engine`` (the worker index), as vLLM; ``gen_ai_*`` use the GenAI attribute names."""

    def __init__(
        self,
        model_name: str,
        engine_index: int | str = 0,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self.model_name = model_name
        self._labels = (model_name, str(engine_index))
        self._prefix_queries_total = 0
        self._prefix_hits_total = 0
        self._build_scheduler_metrics()
        self._build_token_metrics()
        self._build_latency_metrics()
        self._build_gen_ai_metrics()
        self._build_guided_metrics()
        self.spec_decode = SpecDecodeMetrics(self.registry, self._labels)

    # --- definitions --------------------------------------------------------------------------
    def _gauge(self, name: str, doc: str) -> Gauge:
        # one live engine per label set: the most recent write wins across processes
        gauge = Gauge(
            name, doc, ENGINE_LABELS, registry=self.registry, multiprocess_mode="mostrecent"
        )
        return gauge.labels(*self._labels)

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(name, doc, ENGINE_LABELS, registry=self.registry).labels(*self._labels)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        hist = Histogram(name, doc, ENGINE_LABELS, registry=self.registry, buckets=buckets)
        return hist.labels(*self._labels)

    def _build_scheduler_metrics(self) -> None:
        g, c, h = self._gauge, self._counter, self._histogram
        self.num_running = g("vllm:num_requests_running", "Requests in the running batch.")
        self.num_waiting = g("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100 percent.")
        self.kv_used = g("inferflow:kv_cache_blocks_used", "KV-cache blocks in use.")
        self.kv_free = g("inferflow:kv_cache_blocks_free", "KV-cache blocks free.")
        self.prefix_queries = c("vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.")
        self.prefix_hits = c("vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.")
        self.prefix_hit_rate = g(
            "inferflow:prefix_cache_hit_rate", "Prefix-cache hits / queries (tokens) since start."
        )
        self.preemptions = c("vllm:num_preemptions", "Preemptions since start.")
        self.batch_size = h("inferflow:batch_size", "Requests per engine step.", COUNT_BUCKETS)
        self.iteration_tokens = h(
            "vllm:iteration_tokens_total",
            "Tokens (prefill + decode) per engine step.",
            COUNT_BUCKETS,
        )

    def _build_token_metrics(self) -> None:
        c, h = self._counter, self._histogram
        self.prompt_tokens = c("vllm:prompt_tokens", "Prefill tokens computed.")
        self.generation_tokens = c("vllm:generation_tokens", "Generation tokens sampled.")
        self.request_prompt_tokens = h(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", COUNT_BUCKETS
        )
        self.request_generation_tokens = h(
            "vllm:request_generation_tokens", "Generated tokens per request.", COUNT_BUCKETS
        )
        self.request_max_tokens = h(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", COUNT_BUCKETS
        )
        success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*ENGINE_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.request_success = {r: success.labels(*self._labels, r) for r in FINISH_REASONS}

    def _build_latency_metrics(self) -> None:
        h, lat = self._histogram, REQUEST_LATENCY_BUCKETS
        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token (s).", TTFT_BUCKETS)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency (s).", ITL_BUCKETS)
        self.tpot = h(
            "vllm:request_time_per_output_token_seconds",
            "Per request: (last - first token) / (tokens - 1) (s).",
            ITL_BUCKETS,
        )
        self.e2e = h("vllm:e2e_request_latency_seconds", "Arrival -> finish (s).", lat)
        self.queue = h("vllm:request_queue_time_seconds", "Time in the waiting queue (s).", lat)
        self.inference = h(
            "vllm:request_inference_time_seconds", "First scheduled -> finish (s).", lat
        )
        self.prefill = h("vllm:request_prefill_time_seconds", "Prefill phase (s).", lat)
        self.decode = h("vllm:request_decode_time_seconds", "Decode phase (s).", lat)

    def _build_guided_metrics(self) -> None:
        c, h = self._counter, self._histogram
        self.guided_mask = h(
            "inferflow:guided_mask_seconds",
            "Per engine step with structured-output rows: time to fill their token masks (s).",
            GUIDED_MASK_BUCKETS,
        )
        self.guided_compile = h(
            "inferflow:guided_compile_seconds",
            "Per structured-output request whose grammar was not cached: compile time (s).",
            GUIDED_COMPILE_BUCKETS,
        )
        self.guided_cache_hits = c(
            "inferflow:guided_grammar_cache_hits",
            "Structured-output requests whose compiled grammar came from the cache.",
        )
        self.guided_compiles = c(
            "inferflow:guided_grammar_compiles",
            "Structured-output requests whose grammar was compiled.",
        )

    def _build_gen_ai_metrics(self) -> None:
        labels = ["gen_ai_operation_name", "gen_ai_request_model"]

        def gen_ai(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, labels, registry=self.registry, buckets=buckets)

        self.gen_ai_ttft = gen_ai(
            "gen_ai_server_time_to_first_token_seconds",
            "gen_ai.server.time_to_first_token",
            GEN_AI_TTFT_BUCKETS,
        )
        self.gen_ai_tpot = gen_ai(
            "gen_ai_server_time_per_output_token_seconds",
            "gen_ai.server.time_per_output_token",
            GEN_AI_TPOT_BUCKETS,
        )
        self.gen_ai_duration = gen_ai(
            "gen_ai_server_request_duration_seconds",
            "gen_ai.server.request.duration",
            GEN_AI_DURATION_BUCKETS,
        )

    # --- recording ----------------------------------------------------------------------------
    def set_state(
        self, num_running: int, num_waiting: int, kv_blocks_used: int, kv_blocks_total: int
    ) -> None:
        """The scheduler's state now: the gauges. Called after every step and whenever the
        engine's state changes without a step (a finished, cancelled or timed-out request), so
        an idle server's gauges read idle."""
        self.num_running.set(num_running)
        self.num_waiting.set(num_waiting)
        if kv_blocks_total > 0:
            self.kv_used.set(kv_blocks_used)
            self.kv_free.set(kv_blocks_total - kv_blocks_used)
            self.kv_usage.set(kv_blocks_used / kv_blocks_total)

    def on_step(self, stats: StepStats) -> None:
        """Record one engine step (gauges set, counters incremented, histograms observed)."""
        if stats.guided_rows:
            self.guided_mask.observe(stats.guided_mask_s)
        self.spec_decode.on_step(stats.spec_decode)
        self.set_state(
            stats.num_running, stats.num_waiting, stats.kv_blocks_used, stats.kv_blocks_total
        )
        if stats.prefix_cache_queries:  # (zero increments skipped: this runs every step)
            self.prefix_queries.inc(stats.prefix_cache_queries)
            self.prefix_hits.inc(stats.prefix_cache_hits)
            self._prefix_queries_total += stats.prefix_cache_queries
            self._prefix_hits_total += stats.prefix_cache_hits
            self.prefix_hit_rate.set(self._prefix_hits_total / self._prefix_queries_total)
        for counter, n in ((self.preemptions, stats.num_preemptions),
                           (self.prompt_tokens, stats.num_prefill_tokens),
                           (self.generation_tokens, stats.num_generation_tokens)):  # fmt: skip
            if n:
                counter.inc(n)
        if stats.batch_size > 0:
            self.batch_size.observe(stats.batch_size)
            self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_generation_tokens)
        for ttft in stats.time_to_first_tokens:
            self.ttft.observe(ttft)
        for gap in stats.inter_token_latencies:
            self.itl.observe(gap)

    def on_request_finished(self, req: FinishedRequestStats) -> None:
        """Record one finished request (TTFT itself is observed at its step, in on_step)."""
        if req.guided_cache_hit is not None:
            if req.guided_cache_hit:
                self.guided_cache_hits.inc()
            else:
                self.guided_compiles.inc()
                self.guided_compile.observe(req.guided_compile_s or 0.0)
        t = req.timings
        e2e, queue = t.e2e_latency, t.queue_time
        if e2e is None or queue is None:
            raise ValueError("timings of an unfinished request (finished_time is None)")
        reason = req.finish_reason if req.finish_reason in self.request_success else "error"
        self.request_success[reason].inc()
        self.e2e.observe(e2e)
        self.queue.observe(queue)
        tpot = t.time_per_output_token
        for hist, value in (
            (self.inference, t.inference_time),
            (self.prefill, t.prefill_time),
            (self.decode, t.decode_time),
            (self.tpot, tpot),
        ):
            if value is not None:
                hist.observe(value)
        self.request_prompt_tokens.observe(req.num_prompt_tokens)
        self.request_generation_tokens.observe(t.num_output_tokens)
        if req.max_tokens is not None:
            self.request_max_tokens.observe(req.max_tokens)
        if reason in ("stop", "length"):  # GenAI server metrics cover successful responses
            labels = (req.operation, self.model_name)
            self.gen_ai_duration.labels(*labels).observe(e2e)
            if t.time_to_first_token is not None:
                self.gen_ai_ttft.labels(*labels).observe(t.time_to_first_token)
            if tpot is not None:
                self.gen_ai_tpot.labels(*labels).observe(tpot)

    def render(self) -> bytes:
        """Exposition text of this (in-memory) registry; multiprocess mode: use render_metrics."""
        return generate_latest(self.registry)
