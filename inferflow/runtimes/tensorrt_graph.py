"""What TensorRT's ONNX parser documents about the layers the canonical graph relies on, checked
on the exported graph (pure: ``onnx`` only, runs anywhere; ``TensorRTRunner`` runs it before a
build, so a graph TensorRT would refuse or mis-lower is a clear error on any machine).

Sources (TensorRT 10.15+ / 11.x; onnx-tensorrt ``docs/operators.md``, NVIDIA's operator pages):

- **TensorScatter** (lowered to ``IKVCacheUpdateLayer``): ``past_cache`` and ``update`` 4-D,
  ``axis`` -2; types FP32/FP16/BF16 (INT32). KVCacheUpdate: the cache "must be a network input
  and have a static sequence length dimension"; the output "must be a network output and shares
  the same device memory address with the cache input"; ``writeIndices`` int32/int64 of shape
  (B,), with ``writeIndices[i] + S <= S_max`` (the runner's ``C_alloc`` headroom).
- **Attention**: Q, K, V and ``attn_mask`` 4-D; ``past_key``/``past_value``/``nonpad_kv_seqlen``
  inputs and the ``present_*``/``qk_matmul_output`` outputs unsupported; ``softcap`` and
  ``qk_matmul_output_mode`` unsupported; Q/K/V FP32/FP16/BF16; the mask bool or of Q's type.
- **RotaryEmbedding**: ``position_ids`` INT64. **RMSNormalization**, **MatMul**: FP32/FP16/BF16.
- **DequantizeLinear**: INT8/INT4/FP8 input, zero point zero (we give none), the scale a
  build-time constant (an initializer) of the input's rank for block quantization. Weight-only
  quantization is INT4's alone ("TensorRT quantizes activations and weights for INT8, FP8, and
  FP4. Weight-only quantization is supported for INT4").
- **Strongly typed networks** (``NetworkDefinitionCreationFlag.STRONGLY_TYPED``, always on in
  TensorRT 11): no implicit casts, so every op's inputs must agree in type as ONNX's own type
  constraints say (checked by ONNX shape inference in strict mode).
- **TopK**: ``sorted`` 1, ``K`` a constant below 3840 (the MoE routing's sort of all routes
  is not: a mixture-of-experts graph is refused).
- Parser opsets 9-24, default domain only (the parser ignores op domains).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import onnx
from onnx import TensorProto, numpy_helper, shape_inference

FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
QUANTIZED = {TensorProto.INT8, TensorProto.INT4, TensorProto.FLOAT8E4M3FN}
MAX_OPSET = 24
# the ops the canonical graph emits, each listed as supported by onnx-tensorrt (types aside)
SUPPORTED_OPS = {
    "Add",
    "And",
    "Attention",
    "Cast",
    "Concat",
    "DequantizeLinear",
    "Div",
    "Equal",
    "Gather",
    "Gelu",
    "GreaterOrEqual",
    "LessOrEqual",
    "MatMul",
    "Mul",
    "RMSNormalization",
    "Range",
    "ReduceSum",
    "Relu",
    "Reshape",
    "RotaryEmbedding",
    "ScatterND",
    "Shape",
    "Sigmoid",
    "Softmax",
    "Split",
    "Squeeze",
    "Sub",
    "Tanh",
    "TensorScatter",
    "TopK",
    "Transpose",
    "Unsqueeze",
}
MAX_TOPK = 3840  # TopK: "`K` input must be less than 3840", and a build-time constant


def _dims(vi: onnx.ValueInfoProto) -> list[int | str]:
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
        for d in vi.type.tensor_type.shape.dim
    ]


def _elem(vi: onnx.ValueInfoProto) -> int:
    return int(vi.type.tensor_type.elem_type)


def _name(t: int) -> str:
    return str(TensorProto.DataType.Name(t))


def infer_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every intermediate value's type and shape, by ONNX shape inference in
    strict mode: a type mismatch an op's constraints forbid (what a strongly typed TensorRT
    network refuses) raises ``shape_inference.InferenceError``."""
    return shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def graph_violations(model: onnx.ModelProto) -> list[str]:
    """Every documented TensorRT constraint (module docstring) the graph breaks, one line each;
    empty when TensorRT's parser should take it as it is."""
    return list(_violations(model))


def check_graph(model: onnx.ModelProto, what: str = "the canonical graph") -> None:
    """Raise ``ValueError`` naming every violation (``graph_violations``)."""
    found = graph_violations(model)
    if found:
        raise ValueError(f"{what} breaks TensorRT's documented constraints: " + "; ".join(found))


class _Values:
    """The typed graph's values: each name's element type and rank (inputs, outputs,
    intermediates, initializers)."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.inits = {t.name: t for t in graph.initializer}
        self.inputs = {vi.name: vi for vi in graph.input}
        self.outputs = {vi.name: vi for vi in graph.output}
        self.values = {vi.name: vi for vi in [*graph.input, *graph.output, *graph.value_info]}

    def dtype(self, name: str) -> int | None:
        if name in self.inits:
            return int(self.inits[name].data_type)
        return _elem(self.values[name]) if name in self.values else None

    def rank(self, name: str) -> int | None:
        if name in self.inits:
            return len(self.inits[name].dims)
        return len(_dims(self.values[name])) if name in self.values else None


def _violations(model: onnx.ModelProto) -> Iterator[str]:
    for opset in model.opset_import:
        if opset.domain not in ("", "ai.onnx"):
            yield f"opset domain {opset.domain!r}: TensorRT's parser ignores op domains"
        elif not 9 <= opset.version <= MAX_OPSET:
            yield f"opset {opset.version}: TensorRT's parser takes opsets 9-{MAX_OPSET}"
    try:
        typed = infer_types(model)
    except shape_inference.InferenceError as exc:
        yield f"types do not agree (a strongly typed network casts nothing): {exc}"
        return
    v = _Values(typed.graph)
    for vi in typed.graph.input:
        if vi.name.startswith("past_") and _elem(vi) not in FLOATS:
            yield f"input {vi.name}: {_name(_elem(vi))} (FP32/FP16/BF16 only)"
    for node in typed.graph.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        where = f"{node.op_type} {node.name}"
        if node.domain not in ("", "ai.onnx"):
            yield f"{where}: domain {node.domain!r} (TensorRT's parser ignores op domains)"
            continue
        if node.op_type not in SUPPORTED_OPS:
            yield f"{where}: not among the ops checked against onnx-tensorrt's support matrix"
        if node.op_type == "TensorScatter":
            yield from _tensor_scatter(where, node, attrs, v)
        elif node.op_type == "Attention":
            yield from _attention(where, node, attrs, v)
        elif node.op_type == "RotaryEmbedding":
            if len(node.input) < 4 or v.dtype(node.input[3]) != TensorProto.INT64:
                yield f"{where}: position_ids must be INT64"
            if v.dtype(node.input[0]) not in FLOATS:
                yield f"{where}: input type {_name(v.dtype(node.input[0]) or 0)} (FP32/FP16/BF16)"
        elif node.op_type in ("RMSNormalization", "MatMul"):
            for name in node.input[:2]:
                if v.dtype(name) not in FLOATS:
                    yield f"{where}: input {name} of type {_name(v.dtype(name) or 0)} (FP32/FP16/BF16)"
        elif node.op_type == "DequantizeLinear":
            yield from _dequantize(where, node, v)
        elif node.op_type == "TopK":
            k = v.inits.get(node.input[1])
            if k is None or int(numpy_helper.to_array(k).reshape(-1)[0]) >= MAX_TOPK:
                yield f"{where}: K must be a constant below {MAX_TOPK}"
            if attrs.get("sorted", 1) != 1:
                yield f"{where}: sorted must be 1"


def _tensor_scatter(
    where: str, node: onnx.NodeProto, attrs: dict[str, Any], v: _Values
) -> Iterator[str]:
    past, update = node.input[0], node.input[1]
    if attrs.get("axis", -2) != -2:
        yield f"{where}: axis {attrs['axis']} (TensorRT requires -2)"
    if attrs.get("mode", b"linear") not in (b"linear", "linear"):
        yield f"{where}: mode {attrs['mode']!r} (TensorRT's KV-cache update is linear only)"
    if v.rank(past) != 4 or v.rank(update) != 4:
        yield f"{where}: past_cache and update must be 4-D"
    if v.dtype(past) not in FLOATS or v.dtype(update) != v.dtype(past):
        yield f"{where}: cache {_name(v.dtype(past) or 0)} / update {_name(v.dtype(update) or 0)}"
    if past not in v.inputs:
        yield f"{where}: the cache {past} must be a network input"
    else:
        seq = _dims(v.inputs[past])[-2] if v.rank(past) == 4 else None
        if not isinstance(seq, int) or seq <= 0:
            yield f"{where}: the cache {past} needs a static sequence length (dim -2 is {seq!r})"
    present = node.output[0]
    if present not in v.outputs:
        yield f"{where}: the updated cache {present} must be a network output"
    elif past in v.inputs and _dims(v.outputs[present]) != _dims(v.inputs[past]):
        yield f"{where}: {present} {_dims(v.outputs[present])} must have {past}'s shape {_dims(v.inputs[past])}"
    if (
        len(node.input) > 2
        and node.input[2]
        and v.dtype(node.input[2]) not in (TensorProto.INT32, TensorProto.INT64)
    ):
        yield f"{where}: write_indices must be int32 or int64"


def _attention(
    where: str, node: onnx.NodeProto, attrs: dict[str, Any], v: _Values
) -> Iterator[str]:
    if len([i for i in node.input if i]) != 4 or len(node.input) > 4:
        yield f"{where}: takes exactly Q, K, V and attn_mask (past_key, past_value, nonpad_kv_seqlen unsupported)"
    if len([o for o in node.output if o]) != 1 or any(node.output[1:]):
        yield f"{where}: present_key/present_value/qk_matmul_output outputs are unsupported"
    for attr in ("softcap", "qk_matmul_output_mode"):
        if attrs.get(attr):
            yield f"{where}: attribute {attr} is unsupported by TensorRT's Attention importer"
    q = node.input[0]
    for name in node.input[:4]:
        if name and v.rank(name) != 4:
            yield f"{where}: {name} must be 4-D (rank {v.rank(name)})"
    if v.dtype(q) not in FLOATS or any(v.dtype(n) != v.dtype(q) for n in node.input[1:3]):
        yield f"{where}: Q/K/V types must be one of FP32/FP16/BF16, all the same"
    if (
        len(node.input) > 3
        and node.input[3]
        and v.dtype(node.input[3]) not in (TensorProto.BOOL, v.dtype(q))
    ):
        yield f"{where}: the mask must be bool or of Q's type"


def _dequantize(where: str, node: onnx.NodeProto, v: _Values) -> Iterator[str]:
    x, scale = node.input[0], node.input[1]
    if v.dtype(x) not in QUANTIZED:
        yield f"{where}: input type {_name(v.dtype(x) or 0)} (INT8/INT4/FP8)"
    if v.dtype(x) == TensorProto.INT8:
        yield f"{where}: INT8 weight-only quantization (TensorRT quantizes INT8 weights only with INT8 activations)"
    if scale not in v.inits:
        yield f"{where}: the scale must be a build-time constant (an initializer)"
    elif v.rank(scale) not in (0, 1, v.rank(x)):
        yield f"{where}: a block scale must have the input's rank"
    if len(node.input) > 2 and node.input[2]:
        yield f"{where}: a zero point (TensorRT's must be zero: give none)"
