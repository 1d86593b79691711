"""The mixture-of-experts MLP (``ModelArch.moe``) in the decoder graph of ``llama_graph``.

What it computes, as transformers' Mixtral / Qwen2-MoE / Qwen3-MoE sparse blocks do, for the
normed MLP input h (N, H): router logits h @ router (H, E) in the activation type; softmax over
all E experts in float32; the top k of those probabilities (renormalised over the k when
``MoE.norm_topk_prob``, always for Mixtral); out = sum over the k of w_k * down_k(act(gate_k(h)) *
up_k(h)). Qwen2-MoE adds sigmoid(h @ shared_gate) * shared_expert(h). The residual add and the
norm before the MLP stay in ``llama_graph``.

One formulation, standard ops only, for both graph forms: the N*k (token, expert) routes are
sorted by expert (an ascending TopK over all R = N*k of them) and split into each expert's rows
by the experts' route counts; each expert is an ordinary 2-D MLP over its rows' tokens, its
weights constant MatMul operands (``_Graph.linear``: MatMulNBits at int8/int4 in the CPU form,
DequantizeLinear -> MatMul in the canonical one), prepacked by ONNX Runtime at load. An expert
no route chose multiplies zero rows: only the routed experts' weights are read. The outputs,
concatenated by expert, go back to route order (ScatterND with the sort's permutation) and are
mixed by the routing weights (a (1, k) @ (k, H) MatMul per token). ~7 nodes per expert and ~20
per layer.

``benchmarks/moe_kernels.py`` measured it (2 cores, H 512, 8 experts of 512, top-2) against ONNX
Runtime 1.32's ``com.microsoft::MoE``/``QMoE`` CPU kernels (one node), a per-token gather of the
routed experts' stacked weights and every expert on every token: at 1 token this form, the
contrib kernels and the fp32/fp16 gather take 0.12-0.23 ms (QMoE int8: 0.06; every expert:
0.3-0.4; a dense MLP of the same active size: 0.06-0.08); at 32 tokens this form 0.87 ms fp32,
1.0 int4, 1.3 int8, against MoE 1.4, QMoE 1.1 (int8) / 1.7 (int4), the gather 16-25 (it copies
N*k experts) and all experts 2.7 (a dense MLP of the same active size: 0.62). The contrib
kernels are slower at fp32, fp16 and int4 past one token, QMoE int8 is faster at 1 token only,
and it computes with int8 activations whatever the accuracy level (top-1 with transformers on
the qwen2_moe_shared case: 89 % against 96 % here); the MoE kernel also takes only SiLU-gated
experts in its interleaved layout and is no standard op for TensorRT.
Router and shared-expert gate stay in the activation type at every precision (E and 1 output
columns: routing decisions are not quantized). Where an expert's intermediate size is not a
multiple of the quantization block, its gate/up columns and down rows are padded with zeros
(act(0) * 0 = 0: the output is unchanged).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto

from inferflow.models.checkpoint import LayerWeights
from inferflow.models.config import ModelArch
from inferflow.models.family import MoE

if TYPE_CHECKING:
    from inferflow.models.onnx_graph import _Graph

Activation = Callable[[str], str]  # graph value -> its activation (``_Layers.activation``)


def moe_mlp(g: _Graph, cfg: ModelArch, i: int, h: str, lw: LayerWeights, activation: Activation) -> str:
    """Layer ``i``'s sparse MLP of the normed input ``h`` (N, H) -> (N, H), without the residual."""
    moe = cfg.moe
    assert moe is not None and cfg.is_sparse(i)
    logits = g.op1("MatMul", [h, g.weight(f"l{i}_router", lw.router)])  # (N, E), activation type
    out = _per_expert(g, i, cfg, h, *route(g, moe, logits), lw, activation)
    if moe.shared_expert:
        out = g.op1("Add", [out, _shared(g, i, h, lw, activation)])
    return out


# --- weights --------------------------------------------------------------------------------

def padded(g: _Graph, inter: int) -> int:
    """The expert intermediate size in the graph: a multiple of the quantization block."""
    bs = g.spec.quant_block_size
    return -(-inter // bs) * bs if g.spec.precision in ("int8", "int4") else inter


def fused(gate: np.ndarray, up: np.ndarray, width: int) -> np.ndarray:
    """(H, 2 * width): [gate | up], each zero-padded to ``width`` columns."""
    h, inter = gate.shape
    out = np.zeros((h, 2 * width), np.float32)
    out[:, :inter], out[:, width:width + inter] = gate, up
    return out


def expert_mlp(g: _Graph, base: str, x: str, weights: tuple[np.ndarray, np.ndarray, np.ndarray],
            activation: Activation) -> str:
    """down(act(gate(x)) * up(x)) of one expert (x (M, H) -> (M, H)), gate and up fused in one
    projection, the intermediate padded as ``padded`` says."""
    gate, up, down = weights
    width = padded(g, gate.shape[1])
    gt, u = g.op("Split", [g.linear(x, base + "_gate_up", fused(gate, up, width)),
                           g.const("split", np.array([width, width], np.int64))], 2, axis=-1)
    padded_down = np.zeros((width, down.shape[1]), np.float32)
    padded_down[:down.shape[0]] = down
    return g.linear(g.op1("Mul", [activation(gt), u]), base + "_down", padded_down)


def _act_type(g: _Graph) -> int:
    return TensorProto.FLOAT16 if g.spec.precision == "fp16" else TensorProto.FLOAT


# --- routing and mixing (standard ops) ----------------------------------------------------

def route(g: _Graph, moe: MoE, logits: str) -> tuple[str, str]:
    """(N, E) logits -> routing weights (N, k) in the activation type and expert ids (N, k)."""
    probs = g.op1("Softmax", [g.op1("Cast", [logits], to=TensorProto.FLOAT)], axis=-1)
    top, index = g.op("TopK", [probs, g.const("k", np.array([moe.top_k], np.int64))], 2, axis=-1)
    if moe.norm_topk_prob:
        top = g.op1("Div", [top, g.op1("ReduceSum", [top, g.const("axes", np.array([-1], np.int64))])])
    return g.op1("Cast", [top], to=_act_type(g)), index


def mix(g: _Graph, y: str, weights: str) -> str:
    """Per-route outputs (N, k, H) weighted by ``weights`` (N, k) and summed -> (N, H)."""
    w = g.op1("Unsqueeze", [weights, g.const("axes", np.array([1], np.int64))])  # (N, 1, k)
    return g.op1("Squeeze", [g.op1("MatMul", [w, y]), g.const("axes", np.array([1], np.int64))])


def _per_expert(g: _Graph, i: int, cfg: ModelArch, h: str, weights: str, index: str, lw: LayerWeights,
                activation: Activation) -> str:
    """Each expert's MLP over the tokens of the routes that chose it -> (N, H) mixed."""
    moe = cfg.moe
    assert moe is not None
    routes = g.op1("Reshape", [index, g.const("shape", np.array([-1], np.int64))])  # (R,) R = N*k, token-major
    # the routes sorted by expert (ascending TopK of all R; ties in any order) and each expert's count
    _, order = g.op("TopK", [g.op1("Cast", [routes], to=TensorProto.FLOAT), g.op1("Shape", [routes])], 2,
                    axis=0, largest=0, sorted=1)  # order (R,): route ids, grouped by expert
    experts = g.const("experts", np.arange(moe.num_experts, dtype=np.int64))
    hits = g.op1("Cast", [g.op1("Equal", [g.op1("Unsqueeze", [routes, g.const("axes", np.array([1], np.int64))]),
                                           experts])], to=TensorProto.INT64)  # (R, E)
    counts = g.op1("ReduceSum", [hits, g.const("axes", np.array([0], np.int64))], keepdims=0)  # (E,)
    x = g.op1("Gather", [h, g.op1("Div", [order, g.const("k", np.array(moe.top_k, np.int64))])], axis=0)
    parts = g.op("Split", [x, counts], moe.num_experts, axis=0)  # expert e's rows (R_e, H), maybe none
    y = g.op1("Concat", [expert_mlp(g, f"l{i}_e{e}", part, lw.expert(e), activation)
                         for e, part in enumerate(parts)], axis=0)  # (R, H), grouped by expert
    y = g.op1("ScatterND", [y, g.op1("Unsqueeze", [order, g.const("axes", np.array([1], np.int64))]), y])
    y = g.op1("Reshape", [y, g.const("shape", np.array([-1, moe.top_k, cfg.hidden_size], np.int64))])  # route order
    return mix(g, y, weights)  # (N, H)


# --- the shared expert (Qwen2-MoE) ----------------------------------------------------------

def _shared(g: _Graph, i: int, h: str, lw: LayerWeights, activation: Activation) -> str:
    """sigmoid(h @ shared_gate) * the shared expert's MLP of h."""
    gate, up, down, shared_gate = lw.shared_expert()
    y = expert_mlp(g, f"l{i}_shared", h, (gate, up, down), activation)
    score = g.op1("Sigmoid", [g.op1("MatMul", [h, g.weight(f"l{i}_shared_expert_gate", shared_gate)])])  # (N, 1)
    return g.op1("Mul", [y, score])
