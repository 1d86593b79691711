#!/usr/bin/env python
"""Two or more inferflow servers up at once, driven in alternating turns: an A/B that this
VM's drift (up to 2x within minutes) cannot decide.

    python benchmarks/side_by_side.py --concurrency 32 --num-prompts 64 --input-len 128 \\
        --output-len 64 --rounds 4 \\
        --variant "continuous=batching=continuous cache=prefix tracing=off" \\
        --variant "none=batching=none cache=prefix tracing=off"
    git worktree add /tmp/before HEAD~1
    python benchmarks/side_by_side.py --model 4m5 --variant "before@/tmp/before=" --variant "after="

``--variant NAME[@CHECKOUT]=OVERRIDES``: a server started as a user starts it
(``python -m inferflow [+model=local model.path=DIR] OVERRIDES``), from ``CHECKOUT`` (another
checkout of inferflow, e.g. a ``git worktree`` of an earlier commit) when given. Every server is
started first and stays up (an idle one uses no CPU); then each round drives every server once
with ``inferflow bench`` on the same requests (new random prompts per round, ``ignore_eos``),
in alternating order (A B, then B A). ``--model tiny`` is the default trained model; ``4m5`` and
``100m`` are the seeded checkpoints of ``benchmarks/peers.py``. Writes
``<results>/<name>-c<N>-r<k>.json`` per run and ``side_by_side.md``: each round's output tok/s,
p99 TTFT and mean TPOT, and each variant's throughput ratio to the first, per round and of the
means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import MODELS, add_path_args, checkpoint  # noqa: E402
from inferflow.bench.suite import free_port, managed_server, run_points, write_report  # noqa: E402

TINY_TOKENIZER = REPO / "inferflow" / "models" / "tiny_llama" / "tokenizer.json"


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: list[str]
    checkout: Path | None  # run the server from this checkout (None: this one)


def parse_variant(text: str) -> Variant:
    """``NAME[@CHECKOUT]=OVERRIDES`` (overrides separated by spaces, possibly none)."""
    head, sep, overrides = text.partition("=")
    name, _, checkout = head.partition("@")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected NAME[@CHECKOUT]=OVERRIDES")
    return Variant(name, overrides.split(), Path(checkout).resolve() if checkout else None)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", type=parse_variant, action="append", required=True)
    p.add_argument("--model", default="tiny", choices=["tiny", *MODELS])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    add_path_args(p, REPO / "benchmarks" / "results" / "side_by_side", peers=False)
    args = p.parse_args()
    variants: list[Variant] = args.variant
    if len({v.name for v in variants}) != len(variants):
        p.error("--variant names must differ")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    if args.model == "tiny":
        model_args: list[str] = []
        workload = ["--tokenizer", str(TINY_TOKENIZER)]
    else:
        hf_dir = checkpoint(args.model, args.models_dir)
        model_args = ["+model=local", f"model.path={hf_dir}"]
        workload = ["--model", hf_dir.name, "--tokenizer", str(hf_dir / "tokenizer.json")]
    workload += ["--dataset-name", "random", "--input-len", str(args.input_len),
                 "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                 "--num-warmups", "2", "--ignore-eos"]
    c, notes = args.concurrency, []
    with contextlib.ExitStack() as running:
        urls = {}
        for v in variants:
            port = free_port()
            argv = [sys.executable, "-m", "inferflow", *model_args, f"server.port={port}", *v.overrides]
            log = args.results_dir / "logs" / f"{v.name}.log"
            urls[v.name] = running.enter_context(
                managed_server(argv, port, log, timeout=900, cwd=v.checkout))
        for rnd in range(1, args.rounds + 1):
            order = variants if rnd % 2 else list(reversed(variants))
            for v in order:  # the same requests for every variant in a round
                notes += run_points(urls[v.name], v.name, [c], [*workload, "--seed", str(rnd)],
                                    args.results_dir, v.overrides, suffix=f"-r{rnd}")
    runs = {v.name: [json.loads((args.results_dir / f"{v.name}-c{c}-r{k}.json").read_text())
                     for k in range(1, args.rounds + 1)] for v in variants}
    write_report(args.results_dir / "side_by_side.md", _table(variants, runs, args), notes)
    return 1 if notes else 0


def _table(variants: list[Variant], runs: dict[str, list[dict]], args: argparse.Namespace) -> str:
    first = variants[0].name
    rows = ["| variant | overrides | tok/s per round | mean tok/s | ratio to "
            f"{first} (per round; of the means) | p99 TTFT ms (mean) | TPOT ms (mean) |",
            "|---|---|---|---|---|---|---|"]
    base = [r["output_throughput"] for r in runs[first]]
    for v in variants:
        tput = [r["output_throughput"] for r in runs[v.name]]
        ratios = ", ".join(f"{t / b:.2f}" for t, b in zip(tput, base, strict=True))
        where = f" (from {v.checkout})" if v.checkout else ""
        rows.append(
            f"| {v.name}{where} | `{' '.join(v.overrides) or '(defaults)'}` | "
            f"{', '.join(f'{t:.0f}' for t in tput)} | {statistics.mean(tput):.1f} | {ratios}; "
            f"{statistics.mean(tput) / statistics.mean(base):.2f} | "
            f"{statistics.mean(r['p99_ttft_ms'] for r in runs[v.name]):.0f} | "
            f"{statistics.mean(r['mean_tpot_ms'] for r in runs[v.name]):.2f} |")
    return (f"# Side by side, {args.model}, concurrency {args.concurrency}\n\n"
            f"{args.num_prompts} prompts of {args.input_len} random tokens -> {args.output_len} "
            f"tokens (ignore_eos) per run; {args.rounds} rounds in alternating order, every "
            "server up throughout.\n\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
