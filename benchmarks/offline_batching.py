"""Offline batching benchmark: the same 64 mixed-length requests under continuous, static and no
batching; writes throughput and latency figures and their ratios to
``benchmarks/results/offline_batching.json`` and prints a table.

    python benchmarks/offline_batching.py           # real engine (LLMEngine) on the embedded tiny Llama
    python benchmarks/offline_batching.py --fake    # scheduler + KV-simulating fake executor

All requests arrive at t0 (offline). Greedy decoding with ``ignore_eos`` so every mode generates
exactly the same tokens (checked: ``outputs_identical``). Definitions follow vLLM ``bench``:
TTFT = arrival -> first token, TPOT = (E2E - TTFT) / (output tokens - 1), throughputs over the
run's wall time. ``--fake`` measures the schedule, not a model: its clock is simulated with a
per-step cost of ``--fake-step-ms + --fake-token-us * tokens in the step`` (a fixed per-call
overhead plus per-token compute, the shape of a small model on CPU).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from inferflow.engine.step import step  # noqa: E402
from inferflow.outputs import RequestMetrics  # noqa: E402
from inferflow.sampling_params import SamplingParams  # noqa: E402
from inferflow.scheduling import Request, Scheduler, SchedulerConfig  # noqa: E402
from inferflow.scheduling.layout import KVLayout  # noqa: E402
from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput  # noqa: E402

MODES = ("continuous", "static", "none")


@dataclass(frozen=True)
class Work:
    prompt: list[int]
    max_tokens: int


@dataclass
class Finished:
    output_token_ids: list[int]
    num_prompt_tokens: int
    metrics: RequestMetrics


@dataclass
class Run:
    mode: str
    wall_s: float
    steps: int
    finished: dict[str, Finished]


def make_workload(n: int, seed: int, vocab: int) -> list[Work]:
    """Mixed lengths: 3/4 chat-like (16-96 prompt, 8-64 out), 1/4 long (192-512 prompt, 32-128 out)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        long = rng.random() < 0.25
        plen = rng.randint(192, 512) if long else rng.randint(16, 96)
        olen = rng.randint(32, 128) if long else rng.randint(8, 64)
        out.append(Work([rng.randrange(3, vocab) for _ in range(plen)], olen))
    return out


def params(w: Work) -> SamplingParams:
    return SamplingParams(max_tokens=w.max_tokens, temperature=0.0, ignore_eos=True)


# -- real engine -----------------------------------------------------------------------------


def run_real(mode: str, work: list[Work], args: argparse.Namespace) -> Run:
    from inferflow.engine.llm_engine import LLMEngine
    from inferflow.models.checkpoint import load_checkpoint
    from inferflow.models.tiny import tiny_llama_path
    from inferflow.stages.detokenizer import StreamingDetokenizer
    from inferflow.stages.executor import OnnxRuntimeExecutor

    # ONNX Runtime over --max-slots slots of --max-model-len (capped at the checkpoint's
    # context), one full slot's worth of 16-token blocks per slot, prefix cache on
    checkpoint = load_checkpoint(args.model or tiny_llama_path())
    context = min(args.max_model_len, checkpoint.config.max_position_embeddings)
    layout = KVLayout.plan(args.max_slots, context)
    executor = OnnxRuntimeExecutor(intra_op_threads=args.threads)
    executor.load(checkpoint, layout)
    budgets = SchedulerConfig(
        mode=mode,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    engine = LLMEngine(
        checkpoint, executor, Scheduler(budgets, layout), StreamingDetokenizer()
    )
    engine.add_request("warmup", work[0].prompt[:16], SamplingParams(max_tokens=4, temperature=0.0))
    while engine.has_unfinished_requests():
        engine.step()
    t0 = time.time()
    for i, w in enumerate(work):
        engine.add_request(str(i), w.prompt, params(w), arrival_time=t0)
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = Finished(
                    out.outputs[0].token_ids, len(out.prompt_token_ids), out.metrics
                )  # type: ignore[arg-type]
    return Run(mode, time.time() - t0, steps, finished)


# -- fake executor, simulated clock ----------------------------------------------------------


class SimClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TimedExecutor:
    """Wraps the fake executor; each step advances the simulated clock by the cost model."""

    def __init__(
        self, inner: object, clock: SimClock, cost: Callable[[SchedulerOutput], float]
    ) -> None:
        self.inner, self.clock, self.cost = inner, clock, cost

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        self.clock.now += self.cost(plan)
        return self.inner.execute(plan)  # type: ignore[attr-defined]


def run_fake(mode: str, work: list[Work], args: argparse.Namespace) -> Run:
    sys.path.insert(0, str(REPO / "tests" / "scheduling"))
    from fake_executor import FakeExecutor

    budgets = SchedulerConfig(
        mode=mode,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    layout = KVLayout(
        max_slots=args.max_slots,
        max_model_len=args.max_model_len,
        block_size=16,
        num_blocks=args.max_slots * args.max_model_len // 16,
    )
    clock = SimClock()
    scheduler = Scheduler(budgets, layout, clock=clock)
    fake = FakeExecutor(
        layout.max_slots, layout.max_model_len, layout.num_blocks, layout.block_size,
        vocab_size=1024,
    )

    def cost(plan: SchedulerOutput) -> float:
        overhead = args.fake_step_ms / 1e3 if plan.chunks else 0.0
        return overhead + plan.num_batched_tokens * args.fake_token_us / 1e6

    executor = TimedExecutor(fake, clock, cost)
    requests = [Request(str(i), w.prompt, params(w), arrival_time=0.0) for i, w in enumerate(work)]
    for r in requests:
        scheduler.add_request(r)
    t0 = time.perf_counter()
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, executor)
        steps += 1
    host_s = time.perf_counter() - t0
    print(
        f"  {mode}: scheduler + fake executor host time {host_s:.2f}s for {steps} steps",
        file=sys.stderr,
    )
    finished = {
        r.request_id: Finished(r.output_token_ids, r.num_prompt_tokens, r.metrics) for r in requests
    }
    return Run(mode, clock.now, steps, finished)


# -- figures ---------------------------------------------------------------------------------


def dist(values: list[float]) -> dict[str, float]:
    a = np.asarray(values, dtype=float)
    return {
        "mean": float(a.mean()),
        "median": float(np.median(a)),
        "p99": float(np.percentile(a, 99)),
    }


def figures(run: Run) -> dict[str, object]:
    fin = list(run.finished.values())
    out_tokens = sum(len(f.output_token_ids) for f in fin)
    prompt_tokens = sum(f.num_prompt_tokens for f in fin)
    m = [f.metrics for f in fin]
    ttft = [x.first_token_time - x.arrival_time for x in m]  # type: ignore[operator]
    e2e = [x.last_token_time - x.arrival_time for x in m]  # type: ignore[operator]
    tpot = [
        (e - t) / (len(f.output_token_ids) - 1)
        for e, t, f in zip(e2e, ttft, fin, strict=True)
        if len(f.output_token_ids) > 1
    ]
    queue = [x.first_scheduled_time - x.arrival_time for x in m]  # type: ignore[operator]
    return {
        "wall_s": run.wall_s,
        "steps": run.steps,
        "requests": len(fin),
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(fin) / run.wall_s,
        "output_throughput": out_tokens / run.wall_s,
        "total_token_throughput": (prompt_tokens + out_tokens) / run.wall_s,
        "ttft_s": dist(ttft),
        "tpot_s": dist(tpot),
        "e2el_s": dist(e2e),
        "queue_s": dist(queue),
    }


def ratios(figs: dict[str, dict]) -> dict[str, float]:
    c = figs["continuous"]
    out = {}
    for other in ("static", "none"):
        o = figs[other]
        out[f"output_throughput_continuous_over_{other}"] = (
            c["output_throughput"] / o["output_throughput"]
        )
        out[f"mean_e2el_{other}_over_continuous"] = o["e2el_s"]["mean"] / c["e2el_s"]["mean"]
        out[f"mean_ttft_{other}_over_continuous"] = o["ttft_s"]["mean"] / c["ttft_s"]["mean"]
    return out


def print_table(figs: dict[str, dict], unit: str) -> None:
    head = f"{'mode':<11}{'wall ' + unit:>10}{'steps':>7}{'req/s':>9}{'out tok/s':>11}{'TTFT mean':>11}{'TTFT p99':>10}{'TPOT mean':>11}{'E2E mean':>10}"
    print(head)
    for mode, f in figs.items():
        print(
            f"{mode:<11}{f['wall_s']:>10.2f}{f['steps']:>7}{f['request_throughput']:>9.2f}{f['output_throughput']:>11.1f}"
            f"{f['ttft_s']['mean']:>11.3f}{f['ttft_s']['p99']:>10.3f}{f['tpot_s']['mean'] * 1e3:>9.2f}ms{f['e2el_s']['mean']:>10.3f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fake", action="store_true", help="fake executor with a simulated clock")
    ap.add_argument(
        "--model", default=None, help="checkpoint folder (default: the embedded tiny Llama)"
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-slots", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads")
    ap.add_argument("--fake-step-ms", type=float, default=2.0)
    ap.add_argument("--fake-token-us", type=float, default=20.0)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="default: benchmarks/results/offline_batching[_fake].json",
    )
    args = ap.parse_args(argv)
    name = "offline_batching_fake.json" if args.fake else "offline_batching.json"
    args.out = args.out or REPO / "benchmarks" / "results" / name

    work = make_workload(args.num_requests, args.seed, vocab=1024)
    runner = run_fake if args.fake else run_real
    runs = {mode: runner(mode, work, args) for mode in MODES}
    figs = {mode: figures(r) for mode, r in runs.items()}
    outputs = [{rid: f.output_token_ids for rid, f in r.finished.items()} for r in runs.values()]
    result = {
        "backend": "fake (simulated clock)" if args.fake else "onnxruntime LLMEngine",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "outputs_identical": all(o == outputs[0] for o in outputs),
        "modes": figs,
        "ratios": ratios(figs),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(figs, "sim s" if args.fake else "s")
    for k, v in result["ratios"].items():
        print(f"{k:<45}{v:>8.2f}")
    print(f"outputs identical across modes: {result['outputs_identical']}  -> {args.out}")
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
