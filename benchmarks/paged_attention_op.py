#!/usr/bin/env python
"""One layer's attention: inferflow.PagedAttention (paged KV) vs ONNX Runtime's GroupQueryAttention
(slot KV), as the CPU engine runs them.

    python benchmarks/paged_attention_op.py                        # ~100M model's heads
    python benchmarks/paged_attention_op.py --batches 1,32 --contexts 512 --rounds 1

Each point is a graph of ``--layers`` attention nodes (own KV per layer, so the KV is read from
memory as in a model, not from one hot buffer), run ``--repeats`` times (median), reported per
layer. GroupQueryAttention as the ``gqa`` graph form emits it: packed QKV, rotary inside, past and
present bound to the same slot buffer of ``--capacity`` positions per row (IOBinding).
PagedAttention as the ``paged`` form will: packed QKV, rotary inside, a block pool of exactly the
blocks the rows use, scattered (permuted block ids, block 0 the null block), output caches bound
to the input caches. Points: decode steps of ``--batches`` rows at each of ``--contexts`` (every
row at that context), and one prefill chunk of each of ``--chunks`` tokens starting at position 0
and at ``--chunk-start``. Rounds alternate the two per point (this VM drifts); the two outputs
are compared on every point's first round (the same K/V content in both layouts).

``--threads 1 --clock cpu`` times CPU time instead of wall time: on a machine shared with other
work, the figures that other load does not inflate.

Writes ``benchmarks/results/paged_attention_op.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from inferflow.runtimes.ort_ops import build  # noqa: E402

RESULTS = HERE / "results"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1),
          helper.make_opsetid("inferflow", 1)]


@dataclass(frozen=True)
class Point:
    kind: str  # decode | prefill
    rows: int
    start: int  # tokens cached per row before the step
    tokens: int  # new tokens per row

    @property
    def context(self) -> int:
        return self.start + self.tokens

    @property
    def label(self) -> str:
        if self.kind == "decode":
            return f"decode B={self.rows} ctx={self.context}"
        return f"prefill {self.tokens} @ {self.start}"


def rotary_tables(length: int, half: int) -> tuple[np.ndarray, np.ndarray]:
    angles = np.arange(length)[:, None] * 10000.0 ** (-np.arange(half) / half)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def options(args: argparse.Namespace, library: Path | None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")  # as the engine runs
    if library is not None:
        so.register_custom_ops_library(str(library))
    return so


class Backend:
    """A session over ``layers`` nodes with every input and output bound."""

    sess: ort.InferenceSession
    binding: ort.IOBinding
    keep: list[np.ndarray]

    width: int  # Hq * D

    def run(self) -> np.ndarray:
        """The first layer's output, (tokens, Hq * D)."""
        self.sess.run_with_iobinding(self.binding)
        return self.binding.copy_outputs_to_cpu()[0].reshape(-1, self.width)

    def seconds(self, repeats: int, clock: Callable[[], float] = time.perf_counter) -> float:
        for _ in range(2):
            self.sess.run_with_iobinding(self.binding)
        times = []
        for _ in range(repeats):
            start = clock()
            self.sess.run_with_iobinding(self.binding)
            times.append(clock() - start)
        return statistics.median(times)


class Gqa(Backend):
    def __init__(self, args: argparse.Namespace, point: Point, qkv: np.ndarray,
                 kv: list[tuple[np.ndarray, np.ndarray]]) -> None:
        hq, hkv, d, c = args.q_heads, args.kv_heads, args.head_dim, args.capacity
        b, s = point.rows, point.tokens
        self.width = hq * d
        cos, sin = rotary_tables(c, d // 2)
        inits = [helper.make_tensor("cos", TensorProto.FLOAT, cos.shape, cos.tobytes(), raw=True),
                 helper.make_tensor("sin", TensorProto.FLOAT, sin.shape, sin.tobytes(), raw=True)]
        inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [b, s, (hq + 2 * hkv) * d]),
                  helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
                  helper.make_tensor_value_info("total", TensorProto.INT32, []),
                  helper.make_tensor_value_info("query_seqlens", TensorProto.INT32, [b])]
        nodes, outputs = [], []
        for i in range(args.layers):
            inputs += [helper.make_tensor_value_info(f"{x}{i}", TensorProto.FLOAT, [b, hkv, c, d]) for x in "kv"]
            nodes.append(helper.make_node(
                "GroupQueryAttention",
                ["qkv", "", "", f"k{i}", f"v{i}", "seqlens_k", "total", "cos", "sin",
                 "", "", "", "", "", "", "", "query_seqlens"],
                [f"out{i}", f"present_k{i}", f"present_v{i}"], domain="com.microsoft",
                num_heads=hq, kv_num_heads=hkv, do_rotary=1, rotary_interleaved=0))
            outputs += [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, [b, s, hq * d])]
            outputs += [helper.make_tensor_value_info(f"present_{x}{i}", TensorProto.FLOAT, [b, hkv, c, d]) for x in "kv"]
        model = helper.make_model(helper.make_graph(nodes, "gqa", inputs, outputs, inits), opset_imports=OPSETS)
        model.ir_version = 9
        self.sess = ort.InferenceSession(model.SerializeToString(), options(args, None),
                                         providers=["CPUExecutionProvider"])
        self.binding = self.sess.io_binding()
        self.keep = [qkv.reshape(b, s, -1), np.full(b, point.context - 1, np.int32),
                     np.array(c, np.int32), np.full(b, s, np.int32)]
        for name, value in zip(("qkv", "seqlens_k", "total", "query_seqlens"), self.keep, strict=True):
            self.binding.bind_cpu_input(name, value)
        for i, (k, v) in enumerate(kv):
            self.binding.bind_output(f"out{i}", "cpu")  # first: run() returns output 0
            for x, buf in (("k", k), ("v", v)):
                self.keep.append(buf)
                self.binding.bind_cpu_input(f"{x}{i}", buf)
                self.binding.bind_output(f"present_{x}{i}", "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)


class Paged(Backend):
    def __init__(self, args: argparse.Namespace, point: Point, qkv: np.ndarray, library: Path,
                 pools: list[tuple[np.ndarray, np.ndarray]], tables: np.ndarray) -> None:
        hq, hkv, d = args.q_heads, args.kv_heads, args.head_dim
        b, s = point.rows, point.tokens
        self.width = hq * d
        cos, sin = rotary_tables(args.capacity, d // 2)
        bs = args.block_size
        kv_type = helper.np_dtype_to_tensor_dtype(pools[0][0].dtype)
        names = ["qkv", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start"]
        types = [TensorProto.FLOAT, TensorProto.INT64, TensorProto.INT64, TensorProto.INT32,
                 TensorProto.INT32, TensorProto.INT32]
        inputs = [helper.make_tensor_value_info(n, t, None) for n, t in zip(names, types, strict=True)]
        inits = [helper.make_tensor("cos", TensorProto.FLOAT, cos.shape, cos.tobytes(), raw=True),
                 helper.make_tensor("sin", TensorProto.FLOAT, sin.shape, sin.tobytes(), raw=True)]
        nodes, outputs = [], []
        for i in range(args.layers):
            inputs += [helper.make_tensor_value_info(f"{x}{i}", kv_type, None) for x in "kv"]
            nodes.append(helper.make_node(
                "PagedAttention",
                ["qkv", f"k{i}", f"v{i}", "positions", "slot_mapping", "block_tables", "seq_lens",
                 "query_start", "cos", "sin"],
                [f"out{i}", f"k_out{i}", f"v_out{i}"], domain="inferflow",
                num_heads=hq, kv_num_heads=hkv, rotary_dim=d))
            outputs += [helper.make_tensor_value_info(f"out{i}", TensorProto.FLOAT, None)]
            outputs += [helper.make_tensor_value_info(f"{x}_out{i}", kv_type, None) for x in "kv"]
        model = helper.make_model(helper.make_graph(nodes, "paged", inputs, outputs, inits), opset_imports=OPSETS)
        model.ir_version = 9
        self.sess = ort.InferenceSession(model.SerializeToString(), options(args, library),
                                         providers=["CPUExecutionProvider"])
        positions = np.tile(np.arange(point.start, point.context), b)
        rows = np.repeat(np.arange(b), s)
        slots = tables[rows, positions // bs].astype(np.int64) * bs + positions % bs
        self.keep = [qkv, positions, slots, tables, np.full(b, point.context, np.int32),
                     (np.arange(b + 1) * s).astype(np.int32)]
        self.binding = self.sess.io_binding()
        for name, value in zip(names, self.keep, strict=True):
            self.binding.bind_cpu_input(name, value)
        for i, (k, v) in enumerate(pools):
            self.binding.bind_output(f"out{i}", "cpu")
            for x, buf in (("k", k), ("v", v)):
                self.keep.append(buf)
                self.binding.bind_cpu_input(f"{x}{i}", buf)
                self.binding.bind_output(f"{x}_out{i}", "cpu", 0, buf.dtype, buf.shape, buf.ctypes.data)


def make_backends(args: argparse.Namespace, point: Point, library: Path) -> dict[str, Backend]:
    """The backends on the same data: each row's cached K/V (already rotated: as the earlier
    steps wrote it) in its slot and in its scattered blocks (float32; and float16, the op's
    fp16-KV form, which GroupQueryAttention has no counterpart of with float32 activations)."""
    rng = np.random.default_rng(0)
    hq, hkv, d, c, bs = args.q_heads, args.kv_heads, args.head_dim, args.capacity, args.block_size
    b = point.rows
    per_row = -(-point.context // bs)
    ids = (rng.permutation(b * per_row) + 1).astype(np.int32)  # block 0: the null block
    tables = ids.reshape(b, per_row)
    qkv = rng.standard_normal((b * point.tokens, (hq + 2 * hkv) * d), np.float32)
    slot_kv, pools = [], []
    for _ in range(args.layers):
        k = np.zeros((b, hkv, c, d), np.float32)
        v = np.zeros_like(k)
        k[:, :, :point.start] = rng.standard_normal((b, hkv, point.start, d), np.float32)
        v[:, :, :point.start] = rng.standard_normal((b, hkv, point.start, d), np.float32)
        pk = np.zeros((b * per_row + 1, hkv, bs, d), np.float32)
        pv = np.zeros_like(pk)
        for row in range(b):  # (Hkv, ctx, D) in blocks of bs positions
            for j, block in enumerate(tables[row]):
                span = slice(j * bs, min((j + 1) * bs, point.start))
                if span.start < span.stop:
                    pk[block, :, :span.stop - span.start] = k[row, :, span]
                    pv[block, :, :span.stop - span.start] = v[row, :, span]
        slot_kv.append((k, v))
        pools.append((pk, pv))
    backends: dict[str, Backend] = {"gqa": Gqa(args, point, qkv, slot_kv),
                                     "paged": Paged(args, point, qkv, library, pools, tables)}
    if args.fp16_kv:
        half = [(k.astype(np.float16), v.astype(np.float16)) for k, v in pools]
        backends["paged_fp16kv"] = Paged(args, point, qkv, library, half, tables)
    return backends


def points(args: argparse.Namespace) -> list[Point]:
    out = [Point("decode", b, ctx - 1, 1) for b in map(int, args.batches.split(","))
           for ctx in map(int, args.contexts.split(","))]
    for chunk in map(int, args.chunks.split(",")):
        out += [Point("prefill", 1, 0, chunk), Point("prefill", 1, args.chunk_start, chunk)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="256,512,1024,2048")
    parser.add_argument("--chunks", default="256,512")
    parser.add_argument("--chunk-start", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--q-heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (with --threads 1), which other load on a "
                             "shared machine does not inflate")
    parser.add_argument("--fp16-kv", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the op on a float16 KV pool")
    parser.add_argument("--out", type=Path, default=RESULTS / "paged_attention_op.json")
    args = parser.parse_args()
    started = time.perf_counter()
    built = build.build_library()
    library = build.paged_attention_library()
    isa = build.check_loads(library)
    print(f"op library {library} ({'reused' if built.reused else 'built'}, build {built.build_seconds:.1f}s, "
          f"kernels {isa}); ONNX Runtime {ort.__version__}, {args.threads} threads")
    if args.clock == "cpu" and args.threads != 1:
        sys.exit("--clock cpu needs --threads 1 (the pool's spinning threads count as CPU time)")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    runs, errors = [], {}
    names = ["gqa", "paged"] + (["paged_fp16kv"] if args.fp16_kv else [])
    print("| round | point | GroupQueryAttention ms/layer | PagedAttention ms/layer | speedup |"
          + (" PagedAttention fp16 KV ms/layer | speedup |" if args.fp16_kv else ""))
    print("|---|---|---|---|---|" + ("---|---|" if args.fp16_kv else ""))
    loads = [os.getloadavg()[0]]
    for rnd in range(1, args.rounds + 1):
        for point in points(args):
            backends = make_backends(args, point, library)
            if rnd == 1:  # the same attention: outputs agree (fp16 KV within its rounding)
                want = backends["gqa"].run()
                errors[point.label] = {name: float(np.abs(backends[name].run() - want).max()) for name in names[1:]}
                for name, err in errors[point.label].items():
                    if err > (2e-2 if "fp16" in name else 1e-3):
                        sys.exit(f"{point.label}: {name} and GroupQueryAttention disagree by {err:.3g}")
                backends = make_backends(args, point, library)  # fresh KV after the check's writes
            order = names if rnd % 2 else names[::-1]
            times = {name: backends[name].seconds(args.repeats, clock) / args.layers for name in order}
            row: dict[str, object] = {
                "round": rnd, "point": point.label, "kind": point.kind, "rows": point.rows,
                "start": point.start, "tokens": point.tokens, "context": point.context,
                **{f"{name}_ms": round(times[name] * 1e3, 3) for name in names},
                **{f"speedup_{name}": round(times["gqa"] / times[name], 2) for name in names[1:]}}
            runs.append(row)
            line = f"| {rnd} | {point.label} | {row['gqa_ms']} | {row['paged_ms']} | {row['speedup_paged']}x |"
            if args.fp16_kv:
                line += f" {row['paged_fp16kv_ms']} | {row['speedup_paged_fp16kv']}x |"
            print(line, flush=True)
            del backends
        loads.append(os.getloadavg()[0])
    keys = [f"{name}_ms" for name in names] + [f"speedup_{name}" for name in names[1:]]
    summary = {}
    for point in points(args):
        mine = [r for r in runs if r["point"] == point.label]
        summary[point.label] = {key: round(statistics.median(float(str(r[key])) for r in mine), 3) for key in keys}
    print("\nmedians over rounds (ms per layer):")
    for label, s in summary.items():
        extra = f"; fp16 KV {s['paged_fp16kv_ms']} ({s['speedup_paged_fp16kv']}x)" if args.fp16_kv else ""
        print(f"  {label}: GroupQueryAttention {s['gqa_ms']}, PagedAttention {s['paged_ms']} "
              f"({s['speedup_paged']}x){extra}")
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    shape = {k: getattr(args, k) for k in ("q_heads", "kv_heads", "head_dim", "capacity", "block_size", "layers")}
    args.out.write_text(json.dumps(
        {"shape": shape, "threads": args.threads, "clock": args.clock, "repeats": args.repeats, "onnxruntime": ort.__version__,
         "cpu": cpu, "cpu_count": os.cpu_count(), "op_kernels": isa, "op_library_key": built.key,
         "op_build_seconds": built.build_seconds, "max_abs_diff_vs_gqa": errors,
         "load_average_1m": [round(x, 2) for x in loads],
         "runs": runs, "summary": summary, "wall_seconds": round(time.perf_counter() - started, 1)},
        indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
