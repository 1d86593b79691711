#!/usr/bin/env python
"""The torch executor (paged KV, Inductor) beside ONNX Runtime (slot KV), same model, same run.

    python benchmarks/executor_compare.py                      # the ~100M model, c1 and c32
    python benchmarks/executor_compare.py --model tiny --concurrency 1,8

For each executor, starts ``python -m inferflow +model=local model.path=<seeded ~100M Llama>
executor=<name>`` and runs ``inferflow bench`` at each concurrency level (random prompts of
``--input-len`` tokens, ``--output-len`` output tokens with ``ignore_eos``, all released at once,
2 warm-up requests), one server after the other on the same machine. Writes
``benchmarks/results/executor-<name>-c<N>.json`` per point and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import free_port, managed_server, run_points  # noqa: E402
from inferflow.models.tiny import SPEC_100M, make_checkpoint, tiny_llama_path  # noqa: E402


def model_path(name: str, root: Path) -> Path:
    if name == "tiny":
        return tiny_llama_path()
    path = root / "llama-100m"
    if not (path / "tokenizer.json").exists():
        make_checkpoint(path, SPEC_100M, seed=0)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["100m", "tiny"], default="100m")
    p.add_argument("--executors", default="onnxruntime,torch")
    p.add_argument("--concurrency", default="1,32")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--results-dir", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "inferflow-bench")
    args = p.parse_args()
    path = model_path(args.model, args.models_dir)
    levels = [int(c) for c in args.concurrency.split(",")]
    workload = ["--model", path.name, "--dataset-name", "random", "--random-input-len",
                str(args.input_len), "--random-output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts), "--num-warmups", "2", "--ignore-eos"]
    failures: list[str] = []
    for executor in args.executors.split(","):
        port = free_port()
        overrides = ["+model=local", f"model.path={path}", f"executor={executor}",
                     f"server.port={port}", "tracing=off", "batching.max_num_seqs=32"]
        log = args.results_dir / "logs" / f"executor-{executor}.log"
        with managed_server([sys.executable, "-m", "inferflow", *overrides], port, log,
                            timeout=1200) as url:
            failures += run_points(url, f"executor-{executor}", levels, workload,
                                   args.results_dir, overrides)
    print(f"\n{'executor':<12} {'conc':>4} {'out tok/s':>10} {'TTFT med ms':>12} {'TPOT med ms':>12}")
    for executor in args.executors.split(","):
        for c in levels:
            f = args.results_dir / f"executor-{executor}-c{c}.json"
            if f.exists():
                r = json.loads(f.read_text())
                print(f"{executor:<12} {c:>4} {r['output_throughput']:>10.1f} "
                      f"{r['median_ttft_ms']:>12.1f} {r['median_tpot_ms']:>12.1f}")
    for note in failures:
        print("FAILED:", note)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
