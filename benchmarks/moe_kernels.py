#!/usr/bin/env python
"""Which ONNX formulation of a mixture-of-experts MLP the CPU form should use, by precision.

    python benchmarks/moe_kernels.py                       # H 512, 8 experts of 512, top-2
    python benchmarks/moe_kernels.py --experts 64 --tokens 1,8

One sparse MLP block (``models/moe_graph.py``, seeded weights), built in each formulation and
run on ``--tokens`` normed tokens, ``--repeats`` times (median), on ONNX Runtime's CPU provider
with ``--threads`` intra-op threads:

- ``per_expert``: what ``models/moe_graph.py`` builds (both graph forms): routes sorted by
  expert, one constant-weight 2-D MLP per expert over its rows (prepacked; MatMulNBits at
  int8/int4);
- ``nonzero``: the same with each expert's routes found by Equal + NonZero (more nodes);
- ``contrib``: ``com.microsoft::MoE`` (fp32/fp16) / ``QMoE`` (int8/int4): one kernel routes,
  groups tokens by expert and runs one GEMM per routed expert;
- ``gather``: standard ops: TopK, each token's k experts gathered from the stacked weights
  (the quantized stack + scales, then DequantizeLinear, at int8/int4), a batched MatMul;
- ``dense``: every expert on every token, mixed by a routing matrix zero off the routed experts
  (the cost of all experts; float weights);
- ``dense_mlp``: a dense SwiGLU MLP with intermediate size top_k x expert size (the MLP of a
  dense model with the same active parameters): what the mixture should cost.

``max_err`` is the largest absolute difference from a float64 numpy evaluation of the same
mixture with unquantized weights (int4's ~0.3 is the weights' rounding). Writes ``benchmarks/results/moe_kernels.json`` and prints a
table. Times are this machine's, measured while it runs; nothing asserts them.

Recorded (``results/moe_kernels.json``; 2 cores, ORT 1.32, defaults, other work on the
machine): at 1 token every form but ``gather``/``dense`` takes 0.11-0.19 ms (QMoE int8 0.06,
``dense_mlp`` 0.06-0.08); at 32 tokens per_expert 0.87 (fp32) / 0.93 (fp16) / 1.28 (int8) /
1.01 (int4) ms, contrib 1.43 / 1.33 / 1.09 / 1.67, gather 15-25, dense 2.7, dense_mlp 0.62 /
0.68 / 1.05 / 0.79; at 256 tokens per_expert 5.1 / 5.8 / 8.9 / 6.8, contrib 6.9 / 7.0 / 8.7 /
6.8, dense_mlp 4.8 / 4.8 / 7.8 / 5.7, gather 110-170.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import helper

from inferflow.models.config import ModelArch
from inferflow.models.family import MoE
from inferflow.models.initializers import InMemoryInitializers
from inferflow.models.llama_graph import GraphSpec, _Graph, _Layers
from inferflow.models.moe_graph import Activation, expert_mlp, fused, mix, moe_mlp, padded, route
from inferflow.models.quantize import QuantizedWeight, quantize_blocked
from inferflow.models.rope import RotarySettings

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("fp32", "fp16", "int8", "int4")


class SyntheticLayer:
    """Seeded router and experts, served as ``LayerWeights`` serves a checkpoint's."""

    def __init__(self, hidden: int, inter: int, experts: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.router = (rng.standard_normal((hidden, experts)) / np.sqrt(hidden)).astype(np.float32)
        self._experts = [tuple((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
                               for shape in ((hidden, inter), (hidden, inter), (inter, hidden)))
                         for _ in range(experts)]

    def expert(self, e: int) -> tuple[np.ndarray, ...]:
        return self._experts[e]

    def reference(self, h: np.ndarray, top_k: int, normalize: bool) -> np.ndarray:
        """The mixture in float64 (transformers' order of operations)."""
        h = h.astype(np.float64)
        logits = h @ self.router
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        index = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
        weights = np.take_along_axis(probs, index, -1)
        if normalize:
            weights /= weights.sum(-1, keepdims=True)
        out = np.zeros_like(h)
        for n in range(h.shape[0]):
            for w, e in zip(weights[n], index[n], strict=True):
                gate, up, down = self._experts[e]
                a = h[n] @ gate
                out[n] += w * (((a / (1 + np.exp(-a))) * (h[n] @ up)) @ down)
        return out


def arch(hidden: int, moe: MoE) -> ModelArch:
    return ModelArch("MixtralForCausalLM", 32, hidden, moe.intermediate_size, 1, 8, 8, hidden // 8, 4096,
                     1e-5, RotarySettings(), False, False, "float32", None, (), moe=moe)


# --- the formulations the product does not use (models/moe_graph.py has per_expert) --------

def stacks(g: _Graph, layer: SyntheticLayer, moe: MoE, interleave: bool) -> tuple[np.ndarray, np.ndarray]:
    """gate|up (E, H, 2I) (columns interleaved [g0, u0, ...] for the contrib kernels) and
    down (E, I, H), I padded to the quantization block."""
    width = padded(g, moe.intermediate_size)
    gate_up, down = [], []
    for e in range(moe.num_experts):
        gate, up, d = layer.expert(e)
        if interleave:
            w = np.zeros((gate.shape[0], 2 * width), np.float32)
            w[:, 0:2 * gate.shape[1]:2], w[:, 1:2 * gate.shape[1]:2] = gate, up
        else:
            w = fused(gate, up, width)
        gate_up.append(w)
        down.append(np.concatenate([d, np.zeros((width - d.shape[0], d.shape[1]), np.float32)]))
    return np.stack(gate_up), np.stack(down)


def quantized(g: _Graph, w: np.ndarray) -> QuantizedWeight:
    return quantize_blocked(w, 8 if g.spec.precision == "int8" else 4, g.spec.quant_block_size)


def contrib(g: _Graph, moe: MoE, h: str, logits: str, layer: SyntheticLayer) -> str:
    """``com.microsoft::MoE`` (fp32/fp16) / ``QMoE`` (int8/int4, MatMulNBits' blocked encoding):
    weights (out, in) per expert, fc1 (E, 2I, H) gate/up interleaved by row, fc2 (E, H, I)."""
    gate_up, down = stacks(g, layer, moe, interleave=True)
    # SwiGLU as transformers computes it: silu(gate) * up, no clamp (alpha 1, beta 0)
    attrs = dict(k=moe.top_k, activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0,
                 activation_beta=0.0, normalize_routing_weights=int(moe.norm_topk_prob))
    if g.spec.precision not in ("int8", "int4"):
        fc1 = g.weight("moe_fc1", gate_up.transpose(0, 2, 1))
        fc2 = g.weight("moe_fc2", down.transpose(0, 2, 1))
        return g.op1("MoE", [h, logits, fc1, "", fc2], domain="com.microsoft", **attrs)
    names: list[str] = []
    for base, stack in (("moe_fc1", gate_up), ("moe_fc2", down)):
        ws = [quantized(g, m) for m in stack]  # per expert: (N, K*bits/8) uint8, scales (N, K/bs)
        names.append(g.const(base + "_q", np.stack([w.matmulnbits_b().reshape(w.n, -1) for w in ws])))
        names.append(g.weight(base + "_scales", np.stack([w.scales.T for w in ws])))
    return g.op1("QMoE", [h, logits, names[0], names[1], "", names[2], names[3]], domain="com.microsoft",
                 expert_weight_bits=8 if g.spec.precision == "int8" else 4,
                 block_size=g.spec.quant_block_size, **attrs)


def stack_gather(g: _Graph, base: str, routes: str, stack: np.ndarray) -> str:
    """``stack`` (E, K, N) gathered at ``routes`` -> (R, K, N); at int8/int4 the quantized
    stack (int8 storage: ONNX's Gather takes no int4) and its scales, then DequantizeLinear."""
    if g.spec.precision not in ("int8", "int4"):
        return g.op1("Gather", [g.weight(base, stack), routes], axis=0)
    ws = [quantized(g, m) for m in stack]
    q = g.const(base + "_q", np.stack([w.q for w in ws]))  # (E, K, N)
    scales = g.const(base + "_scales", np.stack([w.scales for w in ws]))  # (E, K/bs, N)
    return g.op1("DequantizeLinear", [g.op1("Gather", [q, routes], axis=0), g.op1("Gather", [scales, routes], axis=0)],
                 axis=1, block_size=g.spec.quant_block_size)


def gather(g: _Graph, moe: MoE, h: str, logits: str, layer: SyntheticLayer, activation: Activation) -> str:
    """Each token's k experts gathered from the stacks, applied as a batched MatMul
    (N*k, 1, H) @ (N*k, H, 2I): a step copies N*k experts' weights."""
    weights, index = route(g, moe, logits)
    gate_up, down = stacks(g, layer, moe, interleave=False)
    width, hidden = down.shape[1], down.shape[2]
    routes = g.op1("Reshape", [index, g.const("shape", np.array([-1], np.int64))])  # (N*k,)
    x = g.op1("Unsqueeze", [h, g.const("axes", np.array([1], np.int64))])  # (N, 1, H)
    x = g.op1("Expand", [x, g.const("shape", np.array([1, moe.top_k, 1], np.int64))])  # (N, k, H)
    x = g.op1("Reshape", [x, g.const("shape", np.array([-1, 1, hidden], np.int64))])  # (N*k, 1, H)
    y = g.op1("MatMul", [x, stack_gather(g, "experts_gate_up", routes, gate_up)])  # (N*k, 1, 2I)
    gate, up = g.op("Split", [y, g.const("split", np.array([width, width], np.int64))], 2, axis=-1)
    y = g.op1("MatMul", [g.op1("Mul", [activation(gate), up]), stack_gather(g, "experts_down", routes, down)])
    return mix(g, g.op1("Reshape", [y, g.const("shape", np.array([-1, moe.top_k, hidden], np.int64))]), weights)


def dense(g: _Graph, moe: MoE, h: str, logits: str, layer: SyntheticLayer, activation: Activation) -> str:
    """Every expert on every token (float weights), mixed by a (N, E) matrix that is zero off
    the routed experts: the cost of all experts."""
    weights, index = route(g, moe, logits)
    e, inter = moe.num_experts, moe.intermediate_size
    experts = [layer.expert(x) for x in range(e)]
    gate_up = np.concatenate([np.concatenate([gt for gt, _, _ in experts], axis=1),
                              np.concatenate([u for _, u, _ in experts], axis=1)], axis=1)  # (H, 2*E*I)
    gate, up = g.op("Split", [g.op1("MatMul", [h, g.weight("experts_gate_up", gate_up)]),
                              g.const("split", np.array([e * inter, e * inter], np.int64))], 2, axis=-1)
    act = g.op1("Reshape", [g.op1("Mul", [activation(gate), up]), g.const("shape", np.array([0, e, inter], np.int64))])
    downs = g.weight("experts_down", np.stack([d for _, _, d in experts]))  # (E, I, H)
    y = g.op1("MatMul", [g.op1("Transpose", [act], perm=[1, 0, 2]), downs])  # (E, N, H)
    y = g.op1("Transpose", [y], perm=[1, 0, 2])  # (N, E, H)
    onehot = g.op1("OneHot", [index, g.const("depth", np.array(e, np.int64)),
                              g.weight("onehot_values", np.array([0.0, 1.0]))], axis=-1)  # (N, k, E)
    mixing = g.op1("MatMul", [g.op1("Unsqueeze", [weights, g.const("axes", np.array([1], np.int64))]), onehot])
    return g.op1("Squeeze", [g.op1("MatMul", [mixing, y]), g.const("axes", np.array([1], np.int64))])


def nonzero(g: _Graph, moe: MoE, h: str, logits: str, layer: SyntheticLayer, activation: Activation) -> str:
    """``per_expert`` with each expert's routes found by its own Equal + NonZero (~4 more nodes
    per expert than one TopK sort and a Split by the experts' counts)."""
    weights, index = route(g, moe, logits)
    routes = g.op1("Reshape", [index, g.const("shape", np.array([-1], np.int64))])  # (R,)
    k = g.const("k", np.array(moe.top_k, np.int64))
    picks, outs = [], []
    for e in range(moe.num_experts):
        hit = g.op1("Equal", [routes, g.const("e", np.array(e, np.int64))])
        picked = g.op1("Reshape", [g.op1("NonZero", [hit]), g.const("shape", np.array([-1], np.int64))])  # (R_e,)
        x = g.op1("Gather", [h, g.op1("Div", [picked, k])], axis=0)
        outs.append(expert_mlp(g, f"e{e}", x, layer.expert(e), activation))
        picks.append(picked)
    order = g.op1("Unsqueeze", [g.op1("Concat", picks, axis=0), g.const("axes", np.array([1], np.int64))])
    y = g.op1("Concat", outs, axis=0)
    y = g.op1("ScatterND", [y, order, y])
    hidden = layer.router.shape[0]
    return mix(g, g.op1("Reshape", [y, g.const("shape", np.array([-1, moe.top_k, hidden], np.int64))]), weights)


def dense_mlp(g: _Graph, cfg: ModelArch, h: str, activation: Activation) -> str:
    """A dense model's MLP with top_k x the expert size: [gate | up], activation, down."""
    assert cfg.moe is not None
    inter, rng = cfg.moe.top_k * cfg.moe.intermediate_size, np.random.default_rng(1)
    gate_up = g.linear(h, "gate_up", rng.standard_normal((cfg.hidden_size, 2 * inter)).astype(np.float32))
    gate, up = g.op("Split", [gate_up, g.const("split", np.array([inter, inter], np.int64))], 2, axis=-1)
    down = rng.standard_normal((inter, cfg.hidden_size)).astype(np.float32)
    return g.linear(g.op1("Mul", [activation(gate), up]), "down", down)


def build(layer: SyntheticLayer, cfg: ModelArch, precision: str, kernel: str) -> bytes:
    """One MLP block, ``h`` (N, H) -> ``y`` (N, H), in formulation ``kernel``."""
    spec = GraphSpec("gqa", precision)
    g = _Graph(spec, InMemoryInitializers())
    activation = _Layers(g, cfg, attention=False).activation
    moe = cfg.moe
    assert moe is not None
    if kernel == "per_expert":
        y = moe_mlp(g, cfg, 0, "h", layer, activation)  # type: ignore[arg-type]
    elif kernel == "dense_mlp":
        y = dense_mlp(g, cfg, "h", activation)
    else:
        logits = g.op1("MatMul", ["h", g.weight("router", layer.router)])
        y = contrib(g, moe, "h", logits, layer) if kernel == "contrib" else \
            KERNELS[kernel](g, moe, "h", logits, layer, activation)
    elem = helper.np_dtype_to_tensor_dtype(spec.act_dtype)
    g.nodes.append(helper.make_node("Identity", [y], ["y"]))
    graph = helper.make_graph(g.nodes, "moe", [helper.make_tensor_value_info("h", elem, ["N", cfg.hidden_size])],
                              [helper.make_tensor_value_info("y", elem, ["N", cfg.hidden_size])], g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return bytes(model.SerializeToString())


KERNELS = {"nonzero": nonzero, "gather": gather, "dense": dense}


def measure(model: bytes, h: np.ndarray, threads: int, repeats: int) -> tuple[float, np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    y = session.run(None, {"h": h})[0]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        session.run(None, {"h": h})
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--inter", type=int, default=512, help="each expert's intermediate size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", default="1,32,256")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_kernels.json")
    args = parser.parse_args()
    moe = MoE(args.experts, args.top_k, args.inter, True, (True,))
    cfg, layer = arch(args.hidden, moe), SyntheticLayer(args.hidden, args.inter, args.experts)
    rng = np.random.default_rng(2)
    rows: list[dict[str, Any]] = []
    print(f"{'precision':9} {'kernel':9} {'tokens':>6} {'ms':>8} {'max_err':>8}")
    for precision in args.precisions.split(","):
        kernels = ["per_expert", "nonzero", "contrib", "gather", "dense_mlp"]
        if precision in ("fp32", "fp16"):
            kernels.insert(2, "dense")
        models = {k: build(layer, cfg, precision, k) for k in kernels}
        for n in (int(t) for t in args.tokens.split(",")):
            h = rng.standard_normal((n, args.hidden)).astype(np.float32)
            ref = layer.reference(h, args.top_k, True)
            dtype = np.float16 if precision == "fp16" else np.float32
            for kernel, model in models.items():
                ms, y = measure(model, h.astype(dtype), args.threads, args.repeats)
                err = None if kernel == "dense_mlp" else float(np.abs(y.astype(np.float64) - ref).max())
                rows.append({"precision": precision, "kernel": kernel, "tokens": n, "ms": round(ms, 4),
                             "max_err": err})
                print(f"{precision:9} {kernel:9} {n:6} {ms:8.3f} {'' if err is None else f'{err:8.4f}'}",
                      flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    setup = {k: v for k, v in vars(args).items() if k != "out"}
    args.out.write_text(json.dumps({
        "benchmark": "moe_kernels", "setup": setup, "onnxruntime": ort.__version__,
        "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
