#!/usr/bin/env python
"""How much a decode attention that reads each KV head once would save over ONNX Runtime's.

    python benchmarks/decode_attention_kernel.py                 # ~100M shape, 3 rounds
    python benchmarks/decode_attention_kernel.py --contexts 335 --rounds 5

ONNX Runtime's CPU ``GroupQueryAttention`` (timed as in ``decode_attention.py``: the CPU form's
node, rotary inside, KV in place) beside ``kernels/decode_attention.cpp``, a plain C++ kernel
that reads each KV head's keys and values once for all the query heads of its group (OpenMP,
as many threads as cores, compiled here with ``g++ -O3 -march=native``). Same shape: ``--rows``
rows of one new token, ``--layers`` layers, every slot holding ``context`` tokens. The kernel
does less than the node (no rotary, no KV write: a few microseconds per row), so the ratio is an
upper bound on what such a kernel saves at this quality. Rounds alternate the two per context
(this VM drifts); the kernel's output is checked against numpy first.

Writes ``benchmarks/results/decode_attention_kernel.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from benchmarks.decode_attention import RESULTS, SHAPE, add_shape_args, measure  # noqa: E402

SOURCE = HERE / "kernels" / "decode_attention.cpp"
# -ffast-math's optimizations one by one: the flag itself also links crtfastmath.o, which turns on
# flush-to-zero for the whole process that loads the library (a test worker's later tests then
# read 1e-320 as 0.0)
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fno-math-errno", "-fno-trapping-math",
         "-ffinite-math-only", "-fassociative-math", "-freciprocal-math", "-fno-signed-zeros",
         "-fopenmp", "-shared", "-fPIC"]


def build(folder: Path) -> ctypes.CDLL:
    """Compile the kernel (``$CXX`` or g++) into ``folder`` and load it."""
    compiler = os.environ.get("CXX") or shutil.which("g++")
    if compiler is None:
        sys.exit("no C++ compiler (set CXX or install g++): the kernel cannot be built")
    library = folder / "libdecode_attention.so"
    subprocess.run([compiler, *FLAGS, "-o", str(library), str(SOURCE)], check=True)
    lib = ctypes.CDLL(str(library))
    pointer, integer = ctypes.c_void_p, ctypes.c_int
    lib.decode_attention.argtypes = [pointer] * 4 + [integer] * 5 + [pointer]
    lib.decode_attention.restype = None
    lib.decode_layer.argtypes = [pointer] * 7 + [integer] * 5 + [pointer] * 2
    lib.decode_layer.restype = None
    return lib


class Kernel:
    """The compiled kernel over ``args.layers`` layers of random KV, as the ORT benchmark has."""

    def __init__(self, lib: ctypes.CDLL, args: argparse.Namespace) -> None:
        self.lib, self.args = lib, args
        rng = np.random.default_rng(1)
        shape = (args.rows, args.kv_heads, args.capacity, args.head_dim)
        self.k = [rng.random(shape, np.float32) for _ in range(args.layers)]
        self.v = [rng.random(shape, np.float32) for _ in range(args.layers)]
        self.q = rng.random((args.rows, args.q_heads * args.head_dim), np.float32)
        self.out = np.empty_like(self.q)

    def run(self, layer: int, context: int) -> np.ndarray:
        a = self.args
        ctx = np.full(a.rows, context, np.int32)
        self.lib.decode_attention(self.q.ctypes.data, self.k[layer].ctypes.data,
                                  self.v[layer].ctypes.data, ctx.ctypes.data, a.rows, a.q_heads,
                                  a.kv_heads, a.capacity, a.head_dim, self.out.ctypes.data)
        return self.out

    def seconds(self, context: int) -> float:
        """Median seconds of all layers (after 3 warm-up runs)."""
        times = []
        for n in range(3 + self.args.repeats):
            start = time.perf_counter()
            for layer in range(self.args.layers):
                self.run(layer, context)
            if n >= 3:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def max_error(self, context: int) -> float:
        """Largest difference from softmax(q k' / sqrt(D)) v in numpy (layer 0)."""
        a = self.args
        got = self.run(0, context).copy()
        group = a.q_heads // a.kv_heads
        q = self.q.reshape(a.rows, a.kv_heads, group, a.head_dim).astype(np.float64)
        k, v = self.k[0][:, :, :context], self.v[0][:, :, :context]
        s = np.einsum("bhgd,bhtd->bhgt", q, k) / np.sqrt(a.head_dim)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        want = np.einsum("bhgt,bhtd->bhgd", p, v).reshape(a.rows, -1)
        return float(np.abs(want - got).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser, "128,335,1000")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_attention_kernel.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # read when loaded
    contexts = [int(x) for x in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        kernel = Kernel(build(Path(folder)), args)
        error = kernel.max_error(contexts[0])
        if error > 1e-4:
            sys.exit(f"the kernel disagrees with numpy: max abs error {error:.3g}")
        rows = []
        print("| round | context | GroupQueryAttention ms | one-read kernel ms | ratio |")
        print("|---|---|---|---|---|")
        for rnd in range(1, args.rounds + 1):
            for context in contexts:
                ort_s = measure(args, np.dtype(np.float32), None, context)
                kernel_s = kernel.seconds(context)
                row = {"round": rnd, "context": context, "gqa_ms": round(ort_s * 1e3, 2),
                       "kernel_ms": round(kernel_s * 1e3, 2), "ratio": round(ort_s / kernel_s, 2)}
                rows.append(row)
                print(f"| {rnd} | {context} | {row['gqa_ms']} | {row['kernel_ms']} | {row['ratio']} |",
                      flush=True)
    def median(key: str, context: int) -> float:
        return round(statistics.median(r[key] for r in rows if r["context"] == context), 2)

    summary = {str(c): {"median_ratio": median("ratio", c), "median_gqa_ms": median("gqa_ms", c),
                        "median_kernel_ms": median("kernel_ms", c)} for c in contexts}
    for c, s in summary.items():
        print(f"context {c}: GroupQueryAttention {s['median_gqa_ms']} ms, kernel {s['median_kernel_ms']} ms "
              f"(median ratio {s['median_ratio']})")
    import onnxruntime as ort

    shape = {k: getattr(args, k) for k in SHAPE}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"shape": shape, "onnxruntime": ort.__version__, "kernel_flags": FLAGS,
         "threads": int(os.environ["OMP_NUM_THREADS"]), "kernel_max_abs_error": error,
         "runs": rows, "summary": summary}, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
