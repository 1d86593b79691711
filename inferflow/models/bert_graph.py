"""Our own ONNX graph for a BERT encoder + sentence-transformers pooling (numpy + onnx.helper).

Graph contract (B = batch, S = padded length, H = hidden, E = H * len(pooling modes))::

    inputs   input_ids       int64 (B, S)   right-padded with any id (masked out)
             attention_mask  int64 (B, S)   1 for real tokens, 0 for padding; row sums >= 1
             token_type_ids  int64 (B, S)
    output   embeddings      float32 (B, E) pooled (modes concatenated), L2-normalised if asked

Only standard ONNX ops (opset 18); ONNX Runtime's optimizer fuses LayerNorm/Gelu/attention
patterns itself. Padding never changes a row's result: masked keys get a -inf-like bias before
softmax and pooling only reads unmasked positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from inferflow.models.bert import BertCheckpoint, BertConfig, PoolingConfig
from inferflow.models.errors import CheckpointError

GRAPH_BUILDER_VERSION = "bert-graph-1"
OPSET = 18


_SHARED: dict[str, np.ndarray] = {
    "one_f": np.array(1.0, dtype=np.float32),
    "half_f": np.array(0.5, dtype=np.float32),
    "sqrt2_f": np.array(math.sqrt(2.0), dtype=np.float32),
    "three_f": np.array(3.0, dtype=np.float32),
    "gelu_c": np.array(0.044715, dtype=np.float32),
    "gelu_k": np.array(math.sqrt(2.0 / math.pi), dtype=np.float32),
    "mask_min": np.array(np.finfo(np.float32).min, dtype=np.float32),
    "norm_eps": np.array(1e-12, dtype=np.float32),
    "count_eps": np.array(1e-9, dtype=np.float32),
    "axes_1_2": np.array([1, 2], dtype=np.int64),
    "axis_1": np.array([1], dtype=np.int64),
    "axis_m1": np.array([-1], dtype=np.int64),
    "zero_i": np.array(0, dtype=np.int64),
    "one_i": np.array(1, dtype=np.int64),
}


@dataclass
class _Graph:
    """Accumulates nodes and initializers; ``op`` returns the name of its (first) output."""

    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: list[onnx.TensorProto] = field(default_factory=list)
    _count: int = 0
    _shared: set[str] = field(default_factory=set)

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def shared(self, name: str) -> str:
        """A named constant from ``_SHARED``, added on first use (unused ones would warn)."""
        if name not in self._shared:
            self._shared.add(name)
            self.const(name, _SHARED[name])
        return name

    def op(self, op_type: str, inputs: list[str], **attrs: Any) -> str:
        self._count += 1
        out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def build_bert_graph(ckpt: BertCheckpoint) -> onnx.ModelProto:
    """Encoder + pooling + optional normalisation for ``ckpt`` as one ONNX model.

    Raises ``CheckpointError`` naming the weight file when a tensor is missing.
    """
    try:
        return _build(ckpt, ckpt.weights())
    except _MissingTensor as e:
        raise CheckpointError(ckpt.weight_files[0], f"tensor {e.args[0]!r} is missing") from None


def _build(ckpt: BertCheckpoint, w: dict[str, np.ndarray]) -> onnx.ModelProto:
    cfg = ckpt.config
    g = _Graph()
    x = _embeddings(g, cfg, w)
    mask_f = g.op("Cast", ["attention_mask"], to=TensorProto.FLOAT)  # (B, S)
    # (1 - mask) * MIN: 0 for real tokens, a huge negative for padding; (B, 1, 1, S)
    bias = g.op("Mul", [g.op("Sub", [g.shared("one_f"), mask_f]), g.shared("mask_min")])
    bias = g.op("Unsqueeze", [bias, g.shared("axes_1_2")])
    for layer in range(cfg.num_layers):
        x = _encoder_layer(g, cfg, w, f"encoder.layer.{layer}.", x, bias)
    pooled = _pool(g, ckpt.pooling, x, mask_f)
    if ckpt.pooling.normalize:
        norm = g.op("ReduceL2", [pooled, g.shared("axis_1")], keepdims=1)  # (B, 1)
        pooled = g.op("Div", [pooled, g.op("Max", [norm, g.shared("norm_eps")])])
    g.nodes.append(helper.make_node("Identity", [pooled], ["embeddings"], name="output"))
    return _model(g, ckpt)


def _model(g: _Graph, ckpt: BertCheckpoint) -> onnx.ModelProto:
    ids = [
        helper.make_tensor_value_info(name, TensorProto.INT64, ["batch", "seq"])
        for name in ("input_ids", "attention_mask", "token_type_ids")
    ]
    out = helper.make_tensor_value_info(
        "embeddings", TensorProto.FLOAT, ["batch", ckpt.embedding_dim]
    )
    graph = helper.make_graph(g.nodes, "bert_encoder", ids, [out], initializer=g.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8  # opset 18 needs IR >= 8; old enough for every onnxruntime >= 1.14
    model.producer_name = "inferflow"
    model.producer_version = GRAPH_BUILDER_VERSION
    onnx.checker.check_model(model, full_check=False)
    return model


def _weight(w: dict[str, np.ndarray], name: str) -> np.ndarray:
    if name not in w:
        raise _MissingTensor(name)
    return w[name]


class _MissingTensor(KeyError):
    pass


def _linear(g: _Graph, w: dict[str, np.ndarray], prefix: str, x: str) -> str:
    """x @ W^T + b; the weight is stored pre-transposed as (in, out)."""
    wt = g.const(prefix + "weight_t", np.ascontiguousarray(_weight(w, prefix + "weight").T))
    return g.op(
        "Add", [g.op("MatMul", [x, wt]), g.const(prefix + "bias", _weight(w, prefix + "bias"))]
    )


def _layer_norm(g: _Graph, cfg: BertConfig, w: dict[str, np.ndarray], prefix: str, x: str) -> str:
    gamma = g.const(prefix + "weight", _weight(w, prefix + "weight"))
    beta = g.const(prefix + "bias", _weight(w, prefix + "bias"))
    return g.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=cfg.layer_norm_eps)


def _embeddings(g: _Graph, cfg: BertConfig, w: dict[str, np.ndarray]) -> str:
    """word + absolute position (0..S-1) + token type embeddings, then LayerNorm: (B, S, H)."""
    word = g.const("word_embeddings", _weight(w, "embeddings.word_embeddings.weight"))
    pos = g.const("position_embeddings", _weight(w, "embeddings.position_embeddings.weight"))
    types = g.const("token_type_embeddings", _weight(w, "embeddings.token_type_embeddings.weight"))
    seq_len = g.op("Squeeze", [g.op("Shape", ["input_ids"], start=1, end=2)])  # scalar S
    positions = g.op("Range", [g.shared("zero_i"), seq_len, g.shared("one_i")])  # (S,)
    x = g.op("Add", [g.op("Gather", [word, "input_ids"]), g.op("Gather", [pos, positions])])
    x = g.op("Add", [x, g.op("Gather", [types, "token_type_ids"])])
    return _layer_norm(g, cfg, w, "embeddings.LayerNorm.", x)


def _encoder_layer(
    g: _Graph, cfg: BertConfig, w: dict[str, np.ndarray], p: str, x: str, bias: str
) -> str:
    """Post-LN transformer block: LN(x + Attn(x)) then LN(h + FFN(h))."""
    attn = _self_attention(g, cfg, w, p + "attention.", x, bias)
    h = _layer_norm(g, cfg, w, p + "attention.output.LayerNorm.", g.op("Add", [attn, x]))
    inter = _activation(g, cfg.hidden_act, _linear(g, w, p + "intermediate.dense.", h))
    out = _linear(g, w, p + "output.dense.", inter)
    return _layer_norm(g, cfg, w, p + "output.LayerNorm.", g.op("Add", [out, h]))


def _self_attention(
    g: _Graph, cfg: BertConfig, w: dict[str, np.ndarray], p: str, x: str, bias: str
) -> str:
    n, d = cfg.num_heads, cfg.head_dim
    heads = g.const(p + "heads_shape", np.array([0, 0, n, d], dtype=np.int64))
    merged = g.const(p + "merged_shape", np.array([0, 0, n * d], dtype=np.int64))

    def split(name: str, perm: list[int]) -> str:  # (B, S, H) -> permuted (B, S, N, D)
        proj = _linear(g, w, p + f"self.{name}.", x)
        return g.op("Transpose", [g.op("Reshape", [proj, heads])], perm=perm)

    q = split("query", [0, 2, 1, 3])  # (B, N, S, D)
    k = split("key", [0, 2, 3, 1])  # (B, N, D, S)
    v = split("value", [0, 2, 1, 3])  # (B, N, S, D)
    scale = g.const(p + "scale", np.array(1.0 / math.sqrt(d), dtype=np.float32))
    scores = g.op("Add", [g.op("Mul", [g.op("MatMul", [q, k]), scale]), bias])  # (B, N, S, S)
    ctx = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])  # (B, N, S, D)
    ctx = g.op("Reshape", [g.op("Transpose", [ctx], perm=[0, 2, 1, 3]), merged])  # (B, S, H)
    return _linear(g, w, p + "output.dense.", ctx)


def _activation(g: _Graph, act: str, x: str) -> str:
    if act == "relu":
        return g.op("Relu", [x])
    if act == "gelu":  # exact: 0.5 * x * (1 + erf(x / sqrt(2)))
        erf = g.op("Erf", [g.op("Div", [x, g.shared("sqrt2_f")])])
        return g.op(
            "Mul", [g.op("Mul", [x, g.shared("half_f")]), g.op("Add", [erf, g.shared("one_f")])]
        )
    # gelu_new / gelu_pytorch_tanh: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3)))
    cube = g.op("Mul", [g.op("Pow", [x, g.shared("three_f")]), g.shared("gelu_c")])
    inner = g.op("Mul", [g.op("Add", [x, cube]), g.shared("gelu_k")])
    half_x = g.op("Mul", [x, g.shared("half_f")])
    return g.op("Mul", [half_x, g.op("Add", [g.op("Tanh", [inner]), g.shared("one_f")])])


def _pool(g: _Graph, pooling: PoolingConfig, x: str, mask_f: str) -> str:
    """(B, S, H) token states -> (B, E), modes concatenated in sentence-transformers order."""
    mask3 = g.op("Unsqueeze", [mask_f, g.shared("axis_m1")])  # (B, S, 1)
    parts = []
    for mode in pooling.modes:
        if mode == "cls":  # right padding: [CLS] is position 0
            parts.append(g.op("Gather", [x, g.shared("zero_i")], axis=1))
        elif mode == "max":  # padding pushed to -inf-like before the max
            pad = g.op("Mul", [g.op("Sub", [g.shared("one_f"), mask3]), g.shared("mask_min")])
            parts.append(g.op("ReduceMax", [g.op("Add", [x, pad]), g.shared("axis_1")], keepdims=0))
        else:  # mean: sum / count; mean_sqrt_len_tokens: sum / sqrt(count)
            summed, count = _masked_sum(g, x, mask3)
            denominator = count if mode == "mean" else g.op("Sqrt", [count])
            parts.append(g.op("Div", [summed, denominator]))
    return parts[0] if len(parts) == 1 else g.op("Concat", parts, axis=1)


def _masked_sum(g: _Graph, x: str, mask3: str) -> tuple[str, str]:
    """Sum of real-token states (B, H) and the real-token count clamped to >= 1e-9 (B, 1)."""
    count = g.op("ReduceSum", [mask3, g.shared("axis_1")], keepdims=0)
    count = g.op("Max", [count, g.shared("count_eps")])
    summed = g.op("ReduceSum", [g.op("Mul", [x, mask3]), g.shared("axis_1")], keepdims=0)
    return summed, count
