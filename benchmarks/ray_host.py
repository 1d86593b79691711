"""The Ray host beside the single-machine server: same model, same client, one run.

    pip install -e ".[ray]"
    python benchmarks/ray_host.py                       # tiny default model, c1, c8 and c32
    python benchmarks/ray_host.py --replicas 1,2 --concurrency 8,32

Servers, one after the other on this machine, each driven by ``inferflow bench`` with the same
requests (``--num-prompts`` random prompts of ``--input-len`` tokens -> ``--output-len`` tokens,
``ignore_eos``, all released at once under the concurrency cap):

- ``single``: ``python -m inferflow`` (LitServe: API process -> queue process -> engine worker);
- ``ray-rN``: ``python -m inferflow server=ray server.num_replicas=N`` on a local Ray instance
  (Serve's HTTP proxy -> ingress replica -> DeploymentHandle -> engine replica).

Writes ``benchmarks/results/ray_host/<server>-c<N>[-rK].json`` and ``ray_host.md`` (throughput,
TTFT p50/p99, TPOT, and the Ray host's ratios to the single server). On a 2-core machine two
engine replicas share the cores, so ``ray-r2`` measures the hop and the routing, not a speed-up.

``--rounds K`` starts every server afresh K times, alternating (single, ray, single, ray, ...):
a shared VM's speed drifts by a third between minutes, so one pair of runs can read 0.84x or
1.00x for the same code. The table gives each round's ratio and the ratio of the mean
throughputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import (  # noqa: E402
    ServerStartError,
    free_port,
    managed_server,
    run_points,
    write_report,
)


def servers(replicas: list[int], extra: list[str]) -> list[tuple[str, list[str]]]:
    """(name, argv) per server; each its own port (a stopped Ray proxy lingers a moment)."""
    def argv(*overrides: str) -> list[str]:
        return [sys.executable, "-m", "inferflow", f"server.port={free_port()}", "tracing=off",
                *overrides]

    out = [("single", argv())]
    out += [(f"ray-r{n}", argv("server=ray", f"server.num_replicas={n}", *extra))
            for n in replicas]
    return out


FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms")


def table(results: Path, names: list[str], levels: list[int], rounds: int) -> str:
    """Mean figures over the rounds; the ratio of the mean throughputs and, with several rounds,
    each round's ratio (single and Ray started one after the other in that round)."""
    lines = ["| server | conc. | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
             "tok/s vs single | per round | TTFT p50 +ms vs single |", "|---" * 9 + "|"]
    for c in levels:
        ref = _mean(results, "single", c, rounds)
        for name in names:
            r = _mean(results, name, c, rounds)
            if r is None:
                continue
            ratio = per_round = hop = "—"
            if ref is not None and name != "single":
                ratio = f"{r['output_throughput'] / ref['output_throughput']:.2f}x"
                hop = f"{r['median_ttft_ms'] - ref['median_ttft_ms']:+.1f}"
                pairs = [(_load(results, name, c, k, rounds),
                          _load(results, "single", c, k, rounds)) for k in range(rounds)]
                per_round = ", ".join(f"{a['output_throughput'] / b['output_throughput']:.2f}"
                                      for a, b in pairs if a and b)
            lines.append(f"| {name} | {c} | {r['output_throughput']:.1f} | "
                         f"{r['median_ttft_ms']:.1f} | {r['p99_ttft_ms']:.1f} | "
                         f"{r['median_tpot_ms']:.2f} | {ratio} | {per_round} | {hop} |")
    return "\n".join(lines)


def _suffix(round_no: int, rounds: int) -> str:
    return f"-r{round_no}" if rounds > 1 else ""


def _load(results: Path, name: str, c: int, round_no: int, rounds: int) -> dict | None:
    f = results / f"{name}-c{c}{_suffix(round_no, rounds)}.json"
    return json.loads(f.read_text()) if f.exists() else None


def _mean(results: Path, name: str, c: int, rounds: int) -> dict | None:
    runs = [r for k in range(rounds) if (r := _load(results, name, c, k, rounds))]
    if not runs:
        return None
    return {key: sum(float(r[key]) for r in runs) / len(runs) for key in FIGURES}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", default="1,2", help="engine replica counts of the Ray host")
    p.add_argument("--concurrency", default="1,8,32", help="c1 isolates the hop: TTFT at no load")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--rounds", type=int, default=1, help="fresh servers, alternating, K times")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results" / "ray_host")
    p.add_argument("ray_overrides", nargs="*", help="more overrides for the Ray host (after --)")
    args = p.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    names = [name for name, _ in servers([int(n) for n in args.replicas.split(",")], [])]
    workload = ["--dataset-name", "random", "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
                "--num-warmups", "4", "--ignore-eos", "--seed", "0"]
    for round_no in range(args.rounds):
        suffix = _suffix(round_no, args.rounds)
        # (fresh ports each round: a stopped Ray proxy lingers a moment)
        for name, argv in servers([int(n) for n in args.replicas.split(",")], args.ray_overrides):
            port = int(next(a for a in argv if a.startswith("server.port=")).split("=")[1])
            log = args.results_dir / "logs" / f"{name}{suffix}.log"
            try:
                with managed_server(argv, port, log, timeout=600) as url:
                    notes += [f"{name}{suffix}: {n}" for n in run_points(
                        url, name, levels, workload, args.results_dir, suffix=suffix)]
            except ServerStartError as exc:
                notes.append(f"{name}{suffix}: {exc}")
    runs = "one run" if args.rounds == 1 else f"{args.rounds} alternating rounds, mean"
    text = (f"# The Ray host beside the single-machine server, {runs}\n\n{args.num_prompts} "
            f"prompts per point of {args.input_len} random tokens -> {args.output_len} output "
            f"tokens (ignore_eos), tiny default model, {os.cpu_count()} cores.\n\n"
            f"{table(args.results_dir, names, levels, args.rounds)}\n")
    write_report(args.results_dir / "ray_host.md", text, notes)
    return 1 if notes else 0


if __name__ == "__main__":
    raise SystemExit(main())
