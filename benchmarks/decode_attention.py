#!/usr/bin/env python
"""What ONNX Runtime's CPU ``GroupQueryAttention`` costs in a decode step, by context length.

    python benchmarks/decode_attention.py                    # shaped like the ~100M model
    python benchmarks/decode_attention.py --rows 8 --contexts 128,1024

A graph of ``--layers`` ``com.microsoft::GroupQueryAttention`` nodes as the CPU form emits them
(packed QKV of one new token per row, rotary inside, past and present KV bound to one buffer of
``--capacity`` positions per slot), run on ``--rows`` rows whose slots hold ``context`` tokens,
each variant in turn, ``--repeats`` times (median). Variants: the KV dtype (float32, float16:
ORT's fp16 kernel converts K and V to fp32 per query head), and ``scale``: the node's default
(alpha = 1/sqrt(D) in the q @ K' GEMM) or 1, as when the queries come pre-scaled (MLAS has an
in-place kernel for one query row only at alpha = 1). ``kv GB/s`` is the K and V bytes the step
must read once (rows x layers x Hkv x context x D x 2) over the time: what a kernel that reads
each KV head once, for all its query heads, would be bounded by is this machine's read
bandwidth.

Writes ``benchmarks/results/decode_attention.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

RESULTS = Path(__file__).resolve().parent / "results"


def session(args: argparse.Namespace, dtype: np.dtype, scale: float | None) -> ort.InferenceSession:
    """``args.layers`` GQA nodes on one shared packed-QKV input; each layer its own KV."""
    elem = helper.np_dtype_to_tensor_dtype(dtype)
    hq, hkv, d, b, c = args.q_heads, args.kv_heads, args.head_dim, args.rows, args.capacity
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.random((c, d // 2), np.float32).astype(dtype), name)
             for name in ("cos", "sin")]
    inputs = [helper.make_tensor_value_info("qkv", elem, [b, 1, (hq + 2 * hkv) * d]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [b]),
              helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    nodes, outputs = [], []
    attrs: dict[str, object] = {"num_heads": hq, "kv_num_heads": hkv, "do_rotary": 1}
    if scale is not None:
        attrs["scale"] = scale
    for i in range(args.layers):
        inputs += [helper.make_tensor_value_info(f"{kind}{i}", elem, [b, hkv, c, d]) for kind in "kv"]
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", f"k{i}", f"v{i}", "seqlens_k", "total", "cos", "sin"],
            [f"out{i}", f"present_k{i}", f"present_v{i}"], domain="com.microsoft", **attrs))
        outputs += [helper.make_tensor_value_info(f"out{i}", elem, [b, 1, hq * d])]
        outputs += [helper.make_tensor_value_info(f"present_{kind}{i}", elem, [b, hkv, c, d]) for kind in "kv"]
    model = helper.make_model(helper.make_graph(nodes, "decode_attention", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")  # as the engine runs
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def measure(args: argparse.Namespace, dtype: np.dtype, scale: float | None, context: int) -> float:
    """Median seconds of one run of all layers, KV buffers shared between past and present."""
    sess = session(args, dtype, scale)
    rng = np.random.default_rng(1)
    b, hkv, c, d = args.rows, args.kv_heads, args.capacity, args.head_dim
    binding = sess.io_binding()
    binding.bind_cpu_input("qkv", rng.random((b, 1, (args.q_heads + 2 * hkv) * d), np.float32).astype(dtype))
    binding.bind_cpu_input("seqlens_k", np.full(b, context - 1, np.int32))
    binding.bind_cpu_input("total", np.array(c, np.int32))
    buffers = []  # (kept alive: ORT writes the new token's K/V into them in place)
    for i in range(args.layers):
        for kind in "kv":
            buf = rng.random((b, hkv, c, d), np.float32).astype(dtype)
            buffers.append(buf)
            binding.bind_cpu_input(f"{kind}{i}", buf)
            binding.bind_output(f"present_{kind}{i}", "cpu", 0, dtype, buf.shape, buf.ctypes.data)
        binding.bind_output(f"out{i}", "cpu")
    for _ in range(3):
        sess.run_with_iobinding(binding)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        sess.run_with_iobinding(binding)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


SHAPE = ("rows", "layers", "q_heads", "kv_heads", "head_dim", "capacity")


def add_shape_args(parser: argparse.ArgumentParser, contexts: str) -> None:
    """The decode step's shape (the ~100M model's by default), contexts and repeats."""
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--q-heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--capacity", type=int, default=2048)
    parser.add_argument("--contexts", default=contexts)
    parser.add_argument("--repeats", type=int, default=15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser, "16,128,335,1000")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_attention.json")
    args = parser.parse_args()
    rows = []
    print("| context | KV dtype | scale | ms (all layers) | kv GB/s |\n|---|---|---|---|---|")
    for context in (int(x) for x in args.contexts.split(",")):
        for dtype, scale in ((np.float32, None), (np.float32, 1.0), (np.float16, None)):
            seconds = measure(args, np.dtype(dtype), scale, context)
            kv_bytes = args.rows * args.layers * args.kv_heads * context * args.head_dim * 2 * np.dtype(dtype).itemsize
            row = {"context": context, "kv_dtype": np.dtype(dtype).name,
                   "scale": "1/sqrt(D)" if scale is None else "1 (queries pre-scaled)",
                   "ms": round(seconds * 1e3, 2), "kv_gb_per_s": round(kv_bytes / seconds / 1e9, 1)}
            rows.append(row)
            print(f"| {context} | {row['kv_dtype']} | {row['scale']} | {row['ms']} | {row['kv_gb_per_s']} |",
                  flush=True)
    shape = {k: getattr(args, k) for k in SHAPE}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"shape": shape, "onnxruntime": ort.__version__, "results": rows}, indent=2) + "\n")
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
