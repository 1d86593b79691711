"""A fast model of a served engine: the real :class:`~inferflow.scheduling.scheduler.Scheduler`
replaying a workload's arrivals on measured step times (``inferflow tune`` ranks candidates
with it before it measures any).

- :class:`CostModel`: seconds of one engine step from its plan,
  ``a + b·rows + c·tokens + d·context/1000`` (rows: the chunks of the step; tokens: what it
  computes; context: the KV positions its rows attend to), fitted (non-negative least squares)
  to steps timed on this machine by :func:`profile_engine`.
- :func:`simulate`: the config's own scheduler (its batching budgets, KV layout and cache, as
  ``create_engine`` builds them) steps a virtual clock by the cost model's step times while
  the workload's requests arrive as ``inferflow bench`` would send them (the same arrival
  offsets, ``max_concurrency`` as a client-side cap). Output: the figures of a served run
  (TTFT/TPOT/E2EL percentiles, throughput, ``request_goodput`` under the SLOs) under vLLM's
  keys, so predictions and measurements share one table.

What it leaves out: HTTP and the API processes (a constant ``overhead_s`` per request is added
to TTFT), speculative decoding (its acceptance depends on the text: real runs decide), the
sampler's cost per token beyond the fitted terms.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from inferflow.bench.arrivals import arrival_offsets
from inferflow.graph import ServingGraph
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.plan import ExecutorOutput, SampledToken, SchedulerOutput
from inferflow.scheduling.request import Request
from inferflow.scheduling.scheduler import Scheduler

FEATURES = ("step", "rows", "tokens", "kcontext")


def plan_features(plan: SchedulerOutput) -> tuple[float, float, float, float]:
    """(1, rows, tokens, context/1000) of one step's plan (the cost model's regressors)."""
    rows = len(plan.chunks)
    tokens = sum(len(c.token_ids) for c in plan.chunks)
    context = sum(c.start_pos + len(c.token_ids) for c in plan.chunks)
    return 1.0, float(rows), float(tokens), context / 1000.0


@dataclass(frozen=True)
class CostModel:
    """Seconds of an engine step: ``coef · plan_features(plan)`` (see the module doc)."""

    coef: tuple[float, float, float, float]
    samples: int = 0
    rmse_s: float = 0.0

    def step_seconds(self, plan: SchedulerOutput) -> float:
        return float(sum(c * x for c, x in zip(self.coef, plan_features(plan), strict=True)))

    @classmethod
    def fit(cls, samples: Sequence[tuple[Sequence[float], float]]) -> CostModel:
        """Non-negative least squares over (features, seconds) samples (every subset of the
        four terms is tried; the best fit with no negative coefficient wins), fitted again
        without the tenth of the steps it fits worst (a step stalled by another process on a
        shared machine says nothing about the engine)."""
        if not samples:
            raise ValueError("no timed steps to fit a cost model to")
        x = np.asarray([s[0] for s in samples], dtype=np.float64)
        y = np.asarray([s[1] for s in samples], dtype=np.float64)
        first = cls._nnls(x, y)
        if len(samples) >= 10:
            residual = np.abs(x @ np.asarray(first.coef) - y)
            keep = residual <= np.quantile(residual, 0.9)
            return cls._nnls(x[keep], y[keep])
        return first

    @classmethod
    def _nnls(cls, x: np.ndarray, y: np.ndarray) -> CostModel:
        best: tuple[float, np.ndarray] | None = None
        for size in range(1, x.shape[1] + 1):
            for cols in itertools.combinations(range(x.shape[1]), size):
                sol, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
                if (sol < 0).any():
                    continue
                coef = np.zeros(x.shape[1])
                coef[list(cols)] = sol
                err = float(np.mean((x @ coef - y) ** 2))
                if best is None or err < best[0] - 1e-15:
                    best = (err, coef)
        assert best is not None  # the intercept alone is never negative for times >= 0
        coef_t = tuple(float(c) for c in best[1])
        return cls((coef_t[0], coef_t[1], coef_t[2], coef_t[3]), len(y), math.sqrt(best[0]))

    def scaled(self, factor: float) -> CostModel:
        return CostModel(tuple(c * factor for c in self.coef), self.samples, self.rmse_s * factor)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {
            "coef_s": dict(zip(FEATURES, self.coef, strict=True)),
            "samples": self.samples,
            "rmse_ms": 1000 * self.rmse_s,
        }


# ------------------------------------------------------------------ the replay


@dataclass(frozen=True)
class Workload:
    """What :func:`simulate` replays (``experiment.workload``'s fields that matter here)."""

    num_prompts: int = 64
    input_len: int = 128
    output_len: int = 64
    request_rate: float = math.inf
    max_concurrency: int | None = 16
    burstiness: float = 1.0
    seed: int = 0

    @classmethod
    def of(cls, node: Any) -> Workload:
        """From ``experiment.workload`` (a DictConfig, dict or WorkloadConfig)."""
        get = node.get if isinstance(node, Mapping) else lambda k, d=None: getattr(node, k, d)
        rate = get("request_rate", math.inf)
        return cls(
            int(get("num_prompts", 64)),
            int(get("input_len", 128)),
            int(get("output_len", 64)),
            float(rate if rate is not None else math.inf),
            get("max_concurrency", 16),
            float(get("burstiness", 1.0)),
            int(get("seed", 0)),
        )


@dataclass
class _Flight:
    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


@dataclass
class SimulationLimits:
    """A replay stops after ``max_steps`` engine steps or ``max_virtual_s`` virtual seconds
    (requests still unfinished then count as failed)."""

    max_steps: int = 200_000
    max_virtual_s: float = 3600.0


def simulate(
    graph: ServingGraph,
    workload: Workload,
    cost: CostModel,
    goodput: Mapping[str, float] | None = None,
    *,
    overhead_s: float = 0.0,
    limits: SimulationLimits | None = None,
    layout: Any = None,
) -> dict[str, Any]:
    """Replay ``workload`` on ``graph``'s scheduler with ``cost``'s step times (module doc).

    Deterministic: the prompts and the arrival offsets come from ``workload.seed``."""
    limits = limits or SimulationLimits()
    layout = layout if layout is not None else graph.check_engine_settings()
    now = 0.0

    def clock() -> float:
        return now

    scheduler = Scheduler(graph.batching, layout, kv=graph.cache.create(layout), clock=clock)
    n = workload.num_prompts
    offsets = arrival_offsets(n, workload.request_rate, workload.burstiness, workload.seed)
    rng = random.Random(workload.seed)
    vocab = max(8, graph.model_arch.vocab_size)
    limit = layout.max_model_len
    input_len = max(1, min(workload.input_len, limit - 1))
    output_len = max(1, min(workload.output_len, limit - input_len))
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    cap = workload.max_concurrency or n
    flights: dict[str, _Flight] = {}
    pending = list(range(n))  # not yet sent, in send order
    in_flight = 0
    done: list[_Flight] = []
    failed = 0
    steps = 0
    token = 5  # what every simulated step samples (ignore_eos: never stops a request)
    while pending or scheduler.has_unfinished_requests():
        # send what has arrived, while the client's concurrency cap allows
        while pending and in_flight < cap and offsets[pending[0]] <= now:
            i = pending.pop(0)
            ids = [rng.randrange(1, vocab) for _ in range(input_len)]
            rid = f"sim-{i}"
            try:
                scheduler.add_request(Request(rid, ids, params, arrival_time=now))
            except ValueError:  # the request could never run on this layout
                failed += 1
                continue
            flights[rid] = _Flight(sent=now)
            in_flight += 1
        if not scheduler.has_unfinished_requests():
            if not pending:
                break
            now = max(now, offsets[pending[0]])  # idle until the next arrival
            continue
        plan = scheduler.schedule()
        now += cost.step_seconds(plan)
        output = ExecutorOutput(
            {c.request_id: SampledToken(token) for c in plan.chunks if c.sample}
        )
        for update in scheduler.update(plan, output):
            flight = flights[update.request.request_id]
            if update.new_token_ids:
                if flight.first is None:
                    flight.first = now + overhead_s
                flight.last = now + overhead_s
                flight.tokens += len(update.new_token_ids)
            if update.request.is_finished:
                done.append(flights.pop(update.request.request_id))
                in_flight -= 1
        steps += 1
        if steps >= limits.max_steps or now >= limits.max_virtual_s:
            failed += len(flights) + len(pending)
            break
    return figures(done, failed, max(now, 1e-9), goodput or {}, steps)


def _summary(values_s: Sequence[float], name: str) -> dict[str, float]:
    data = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64) * 1000.0
    return {
        f"mean_{name}_ms": float(np.mean(data)),
        f"median_{name}_ms": float(np.median(data)),
        f"p90_{name}_ms": float(np.percentile(data, 90)),
        f"p99_{name}_ms": float(np.percentile(data, 99)),
    }


def figures(
    done: Sequence[_Flight],
    failed: int,
    duration: float,
    goodput: Mapping[str, float],
    steps: int = 0,
) -> dict[str, Any]:
    """A replay's figures under ``inferflow bench``'s keys (vLLM's definitions)."""
    ttft = [f.first - f.sent for f in done if f.first is not None]
    e2el = [f.last - f.sent for f in done if f.last is not None]
    tpot = [
        (f.last - f.first) / (f.tokens - 1)
        for f in done
        if f.first is not None and f.last is not None and f.tokens > 1
    ]
    tpot_all = [
        (f.last - f.first) / (f.tokens - 1) if f.tokens > 1 else 0.0
        for f in done
        if f.first is not None and f.last is not None
    ]
    columns = {"ttft": ttft, "tpot": tpot_all, "e2el": e2el}
    good = (
        sum(
            all(columns[name][i] * 1000.0 <= limit for name, limit in goodput.items())
            for i in range(len(ttft))
        )
        if goodput
        else len(ttft)
    )
    out_tokens = sum(f.tokens for f in done)
    total = len(done) + failed
    return {
        "duration": duration,
        "completed": len(done),
        "failed": failed,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "request_goodput": good / duration if goodput else None,
        "slo_attainment": good / total if total else 0.0,
        **_summary(ttft, "ttft"),
        **_summary(tpot, "tpot"),
        **_summary(e2el, "e2el"),
        "sim_steps": steps,
    }


# ------------------------------------------------------------------ timing engine steps


@dataclass
class _TimedExecutor:
    """Wraps the executor the engine step calls; keeps the features of the plan it ran last."""

    inner: Any
    last: tuple[float, float, float, float] | None = None

    def execute(self, plan: SchedulerOutput) -> Any:
        self.last = plan_features(plan) if plan.chunks else None
        return self.inner.execute(plan)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@dataclass
class Profile:
    """The timed steps of one engine (:func:`profile_engine`) and the model fitted to them."""

    cost: CostModel
    samples: list[tuple[tuple[float, float, float, float], float]] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the profile, engine start included

    def to_dict(self) -> dict[str, Any]:
        return {**self.cost.to_dict(), "profile_s": self.seconds}


def profile_rows(max_rows: int) -> list[int]:
    """Batch sizes a profile times: powers of two up to ``max_rows``, and ``max_rows``."""
    rows = [r for r in (1, 2, 4, 8, 16, 32, 64, 128, 256) if r < max_rows] + [max_rows]
    return sorted(set(rows))


def profile_engine(
    graph: ServingGraph,
    *,
    input_len: int,
    max_rows: int,
    decode_steps: int = 6,
    log: Callable[[str], None] | None = None,
) -> Profile:
    """Time engine steps of ``graph`` (loaded here, once) for batches of 1 .. ``max_rows``
    requests of ``input_len`` prompt tokens: their prefill steps (under the graph's token
    budget) and ``decode_steps`` decode steps; fit a :class:`CostModel` to them. A first,
    unrecorded batch warms the engine up."""
    from inferflow.experiment.offline import wait_resident

    started = time.perf_counter()
    timed: list[_TimedExecutor] = []

    def wrap(executor: Any, stats: Any) -> Any:
        timed.append(_TimedExecutor(executor))
        return timed[-1]

    engine = graph.create_engine(wrap_executor=wrap)
    try:
        wait_resident(engine)
        vocab = engine.model_config.vocab_size
        limit = engine.max_model_len
        input_len = max(1, min(input_len, limit - decode_steps - 1))
        rng = random.Random(0)
        params = SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True)
        samples: list[tuple[tuple[float, float, float, float], float]] = []
        rows_list = profile_rows(max(1, min(max_rows, graph.batching.max_num_seqs)))
        for pass_no, rows in enumerate([2, *rows_list]):
            for i in range(rows):
                ids = [rng.randrange(1, vocab) for _ in range(input_len)]
                engine.add_request(f"profile-{pass_no}-{i}", ids, params)
            while engine.has_unfinished_requests():
                t0 = time.perf_counter()
                engine.step()
                dt = time.perf_counter() - t0
                features = timed[0].last if timed else None
                if pass_no > 0 and features is not None:
                    samples.append((features, dt))
                if timed:
                    timed[0].last = None
            if log is not None and pass_no > 0:
                log(f"profile: {rows} rows timed")
    finally:
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    cost = CostModel.fit(samples)
    return Profile(cost, samples, time.perf_counter() - started)
