#!/usr/bin/env python
"""Where an engine call's time goes, by ONNX Runtime operator, beside what the cores can do.

    python benchmarks/engine_profile.py                        # ~100M, context 320
    python benchmarks/engine_profile.py --model 4m5 --repeats 40

Builds the engine as the server does (fp32, the in-place GQA form, 2,048 positions per slot) on
a seeded checkpoint and times three calls shaped like the peers benchmark's steps: one decode
row, ``--rows`` decode rows (both at ``--context`` tokens), and ``--prompts`` prompt chunks of
256 tokens. For each: the call's wall time (median of ``--repeats``, no profiler), then ONNX
Runtime's profile of the same calls in a second session of the same engine (per operator type,
ms per call; the profiler adds a little to each operator).

Beside them, the floors this machine sets, measured the same way:

- ``stream``: a chain of MatMuls with the checkpoint's weight shapes (the fused QKV, output,
  gate-and-up, down projections of every layer and the LM head) at one row. Its GB/s is how fast
  two threads stream the weights with no other operator: batch-1 decode's floor.
- ``gemm``: the largest of those MatMuls at ``--rows`` and at 2,048 rows (GFLOP/s): MLAS's GEMM
  at decode and at prefill size.

Writes ``benchmarks/results/engine_profile-<model>.json`` and prints a table (the source of
docs/performance.md's per-operator figures).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.peers import MODELS, add_path_args, checkpoint  # noqa: E402
from inferflow.models.checkpoint import load_checkpoint  # noqa: E402
from inferflow.runtimes.config import OrtSettings  # noqa: E402
from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner  # noqa: E402
from inferflow.runtimes.step_inputs import EngineRow  # noqa: E402
from inferflow.scheduling.layout import KVLayout  # noqa: E402

GEMM_OPS = ("MatMul", "Gemm", "FusedMatMul")


def calls(args: argparse.Namespace, vocab: int) -> dict[str, list[EngineRow]]:
    """The three calls, on fixed random tokens (slots 0.. in order, as a full batch binds them)."""
    rng = np.random.default_rng(0)
    decode = [EngineRow(s, (int(rng.integers(vocab)),), args.context, True) for s in range(args.rows)]
    prefill = [EngineRow(s, tuple(int(t) for t in rng.integers(vocab, size=256)), 0, True)
               for s in range(args.prompts)]
    return {"decode x1": decode[:1], f"decode x{args.rows}": decode, f"prefill {args.prompts}x256": prefill}


def wall_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median ms of ``repeats`` calls of ``fn`` after one warm-up call."""
    fn()  # warm
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def op_profile(runner: OnnxRuntimeRunner, rows: list[EngineRow], repeats: int) -> dict[str, float]:
    """ms per call by operator type, from ONNX Runtime's profiler (the first call is dropped)."""
    options = runner.session_options()
    options.enable_profiling = True
    folder = tempfile.TemporaryDirectory()
    options.profile_file_prefix = str(Path(folder.name) / "ort")
    plain, runner.session = runner.session, ort.InferenceSession(
        str(runner.cache_entry.model_path), options, providers=["CPUExecutionProvider"])
    runner._bindings.clear()  # they belong to the session
    try:
        for _ in range(repeats + 1):
            runner.forward(rows)
        events = json.loads(Path(runner.session.end_profiling()).read_text())
    finally:
        runner.session = plain
        runner._bindings.clear()
        folder.cleanup()
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[1:]
    per_op: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") \
                and any(lo <= e["ts"] <= hi for lo, hi in runs):
            per_op[e["args"]["op_name"]] += e["dur"] / 1e3 / len(runs)
    return dict(sorted(per_op.items(), key=lambda kv: -kv[1]))


def weight_shapes(runner: OnnxRuntimeRunner) -> list[tuple[int, int]]:
    """(K, N) of every weight the engine's MatMul and Gemm nodes read, in graph order."""
    model = onnx.load(str(runner.cache_entry.model_path), load_external_data=False)
    dims = {init.name: tuple(init.dims) for init in model.graph.initializer}
    return [dims[node.input[1]] for node in model.graph.node  # type: ignore[misc]
            if node.op_type in ("MatMul", "Gemm") and len(dims.get(node.input[1], ())) == 2]


def matmul_session(shapes: list[tuple[int, int]], threads: int) -> ort.InferenceSession:
    """One MatMul per (K, N) weight, each on the first K columns of one input: every call reads
    every weight once, as the engine's call does, with no other operator in between."""
    rng = np.random.default_rng(0)
    const = numpy_helper.from_array
    inits = [const(np.array([0], np.int64), "zero"), const(np.array([1], np.int64), "axis")]
    nodes, outputs = [], []
    for k in sorted({k for k, _ in shapes}):
        inits.append(const(np.array([k], np.int64), f"k{k}"))
        nodes.append(helper.make_node("Slice", ["x", "zero", f"k{k}", "axis"], [f"x{k}"]))
    for i, (k, n) in enumerate(shapes):
        inits.append(const((rng.random((k, n), np.float32) - 0.5) * 0.01, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [f"x{k}", f"w{i}"], [f"y{i}"]))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [None, n]))
    width = max(k for k, _ in shapes)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, width])
    model = helper.make_model(helper.make_graph(nodes, "weights", [x], outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def floors(shapes: list[tuple[int, int]], args: argparse.Namespace) -> dict[str, float]:
    width = max(k for k, _ in shapes)
    chain = matmul_session(shapes, args.threads)
    one = np.random.default_rng(1).random((1, width), np.float32)
    ms = wall_ms(lambda: chain.run(None, {"x": one}), args.repeats)
    out = {"stream_ms": ms, "stream_GBps": sum(k * n for k, n in shapes) * 4 / ms / 1e6}
    k, n = max(shapes, key=lambda s: s[0] * s[1])
    gemm = matmul_session([(k, n)], args.threads)
    for m in (args.rows, 2048):
        x = np.random.default_rng(2).random((m, k), np.float32)
        ms = wall_ms(partial(gemm.run, None, {"x": x}), max(3, args.repeats // 4))
        out[f"gemm_M{m}_GFLOPs"] = 2 * m * k * n / ms / 1e6
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="100m", choices=sorted(MODELS))
    p.add_argument("--checkpoint", type=Path, help="a Llama checkpoint instead of --model's seeded one")
    p.add_argument("--context", type=int, default=320, help="tokens in each decode row's slot")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: one per core)")
    add_path_args(p, REPO / "benchmarks" / "results", peers=False)
    args = p.parse_args()
    path = args.checkpoint or checkpoint(args.model, args.models_dir)
    name = path.name if args.checkpoint else args.model
    layout = KVLayout.plan(max(args.rows, args.prompts), 2048)
    runner = OnnxRuntimeRunner(load_checkpoint(path), OrtSettings(intra_op_threads=args.threads), layout)
    while not runner.kv_resident:
        time.sleep(0.1)
    timed: dict[str, dict[str, object]] = {}
    rows_of = calls(args, runner.model_config.vocab_size)
    for label, rows in rows_of.items():
        repeats = args.repeats if len(rows) * len(rows[0].token_ids) < 1024 else max(3, args.repeats // 5)
        wall = wall_ms(partial(runner.forward, rows), repeats)
        ops = op_profile(runner, rows, repeats)
        timed[label] = {"wall_ms": wall, "tokens": sum(len(r.token_ids) for r in rows), "ops_ms": ops}
    result = {"model": name, "context": args.context, "threads": args.threads, "onnxruntime": ort.__version__,
              "calls": timed, "floors": floors(weight_shapes(runner), args)}
    args.results_dir.mkdir(parents=True, exist_ok=True)
    (args.results_dir / f"engine_profile-{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    return 0


def table(result: dict) -> str:
    lines = [f"engine profile, {result['model']}, context {result['context']} (ms per call)", "",
             "| call | wall | profiled | GEMMs | GroupQueryAttention | other operators (largest) |",
             "|---|---|---|---|---|---|"]
    for label, call in result["calls"].items():
        ops = call["ops_ms"]
        gemm = sum(v for k, v in ops.items() if k in GEMM_OPS)
        gqa = ops.get("GroupQueryAttention", 0.0)
        rest = {k: v for k, v in ops.items() if k not in GEMM_OPS and k != "GroupQueryAttention"}
        top = ", ".join(f"{k} {v:.2f}" for k, v in list(rest.items())[:3])
        lines.append(f"| {label} | {call['wall_ms']:.2f} | {sum(ops.values()):.2f} | {gemm:.2f} | "
                     f"{gqa:.2f} | {sum(rest.values()):.2f} ({top}) |")
    f = result["floors"]
    gemms = ", ".join(f"{k.split('_')[1]} {v:.0f} GFLOP/s" for k, v in f.items() if k.startswith("gemm"))
    lines += ["", f"floors: the weights as MatMuls at one row {f['stream_ms']:.2f} ms "
                  f"({f['stream_GBps']:.1f} GB/s); the largest MatMul at {gemms}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
