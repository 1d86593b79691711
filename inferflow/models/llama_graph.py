"""Decoder checkpoint -> ONNX graph, in two forms built from the same layer code.

Every dense family ``models/families/`` describes is the Llama decoder plus what
``ModelArch.block`` and the per-layer windows and rotary say: RMSNorm by (offset + w) with the
offset folded into the weight (Gemma's 1 + w, added in float32), q/k norms over each head before
rotary, sandwich norms around the attention and the MLP, the embedding scale, the final logits'
soft-cap (here) and the attention's scale, soft-cap, windows and (partial, per-layer) rotary
(``graph_attention``). A graph of a model with none of them is the Llama graph, node for node.

- ``canonical``: standard ONNX ops only (opset 24: RMSNormalization, RotaryEmbedding,
  TensorScatter, Attention, DequantizeLinear). The form TensorRT parses; on ONNX Runtime it is
  the reference the tests compare the CPU form with.
- ``gqa``: the CPU form. ``com.microsoft::GroupQueryAttention`` applies rotary itself and writes
  the new K/V into the slot buffers in place (past_key and present_key bound to one buffer);
  int8/int4 weights use ``com.microsoft::MatMulNBits``.

- ``paged``: the CPU form over a paged KV pool: one ``inferflow::PagedAttention`` per layer
  (``graph_attention``; the custom op of ``runtimes/ort_ops/``) reads and writes the block pool
  through the step's block tables; no padding anywhere (its inputs are below).

The slot forms take the same *packed* step (a prefill chunk or decode token per row) and only pad
for attention. Shapes: N packed tokens, B rows (slots), S padded chunk length, R sampled rows,
C slot capacity, H hidden, Hq/Hkv heads, D head dim, V vocab.

Inputs (both forms)
  input_ids    int64 (N,)    tokens of every row, row after row
  pad_index    int64 (B, S)  packed index of padded position (b, s); N = padding (a zero row)
  unpad_index  int64 (N,)    flat padded position b*S + s of packed token n
  logits_index int64 (R,)    packed tokens whose next-token logits are returned
  past_key_{i}, past_value_{i}  (B, Hkv, C, D) per layer (canonical form: C is the static
                 ``GraphSpec.max_model_len``; gqa form: symbolic)
GQA form: seqlens_k int32 (B,) = tokens in the slot after the step - 1; total_seq_len int32 ()
  = C; query_seqlens int32 (B,) valid tokens per row (0 = idle slot).
Canonical form: position_ids int64 (B, S); write_indices int64 (B,) = tokens before the step.
Outputs: logits float32 (R, V); present_key_{i}, present_value_{i} (B, Hkv, C, D).

Paged form (B rows, W block-table width, NB blocks of BS positions):
  input_ids int64 (N,), positions int64 (N,), slot_mapping int64 (N,) = block * BS + offset of
  each token's K/V, block_tables int32 (B, W), seq_lens int32 (B,) = tokens after the step,
  query_start int32 (B + 1,) = cumulative tokens per row, logits_index int64 (R,),
  key_cache_{i}, value_cache_{i} (NB, Hkv, BS, D); outputs logits and present_key_{i},
  present_value_{i} (NB, Hkv, BS, D), the caches after the write (bound to the inputs' memory).
The slot buffers hold the whole context on every layer, windowed ones included
(``graph_attention``).

Multi-LoRA (``GraphSpec.lora``, the CPU forms): the target projections' deltas and their
graph inputs are ``lora_graph``'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper

from inferflow.models.checkpoint import LayerWeights, ModelWeights
from inferflow.models.config import ModelArch
from inferflow.models.family import Block
from inferflow.models.graph_attention import Attention
from inferflow.models.initializers import InitializerStore, InMemoryInitializers
from inferflow.models.lora_graph import LoraDeltas, check_lora
from inferflow.models.moe_graph import moe_mlp
from inferflow.models.onnx_graph import PAGED_OP_DOMAIN, GraphSpec, _Graph

# 5: rope types, activations and biases from transformers 5 configs; 6: the families' blocks,
# windows, per-layer and partial rotary; 7: canonical form: a static KV length, TensorScatter
# axis -2, bf16
GRAPH_BUILDER_VERSION = "7"


def _ffn_padding(spec: GraphSpec, inter: int) -> int:
    """Zero columns appended to the MLP's intermediate activations in the CPU form (0 or 32).

    MLAS's GEMM kernel reads ~12 rows of its left operand at once; when a row is a multiple of
    4 KiB long (an intermediate size of 2,048 in fp32, 14,336 in Llama-3-8B), those rows map to the
    same L1 cache sets and evict each other (4K aliasing). On the ~100M seeded model's down
    projection (2,048 -> 768, 2 Zen 4 cores) that ran at ~135 GFLOP/s against ~200 with 2,080
    columns at 2,048 rows (prefill), and at ~130 against ~161 at 32 rows (decode). 32 keeps the width a
    multiple of the int8/int4 block size; those forms quantize the activations to their own
    buffer, so only float precisions are padded, and only the CPU form.
    """
    itemsize = np.dtype(spec.act_dtype).itemsize
    if not spec.cpu or spec.precision not in ("fp32", "fp16") or (inter * itemsize) % 4096:
        return 0
    return 32


def norm_weight(block: Block, w: np.ndarray) -> np.ndarray:
    """An RMSNorm's weight with the family's offset folded in: offset + w, added in float32
    (transformers' Gemma norm scales by 1 + w in float32; an fp16 engine then rounds the sum once,
    where its weight was read as float16)."""
    return w if not block.norm_offset else block.norm_offset + w.astype(np.float32)


class _Layers:
    """Emits the decoder; the attention differs by form (``graph_attention``), everything else
    is shared."""

    def __init__(self, g: _Graph, cfg: ModelArch, attention: bool = True) -> None:
        self.g, self.cfg = g, cfg
        self.attention = Attention(g, cfg) if attention else None
        self.lora = LoraDeltas(g, g.spec.lora) if g.spec.lora is not None else None

    def norm(self, x: str, w: np.ndarray) -> str:
        return self.g.rms_norm(x, norm_weight(self.cfg.block, w), self.cfg.rms_norm_eps)

    def layer(self, i: int, x: str, lw: LayerWeights) -> str:
        assert self.attention is not None
        return self.mlp(i, self.attention_out(i, x, self.attention(i, self.qkv(i, x, lw)), lw), lw)

    def attention_out(self, i: int, x: str, attn: str, lw: LayerWeights) -> str:
        """x + the output projection of layer ``i``'s attention ``attn`` (N, Hq * D), normed
        first with sandwich norms."""
        y = self.g.linear(attn, f"l{i}_o", lw.wo, lw.bo)
        if self.lora is not None:
            qw, h = self.cfg.num_heads * self.cfg.head_dim, self.cfg.hidden_size
            y = self.lora.add(y, self.lora.fused(i, attn, [("o_proj", qw, h, None)]))
        if self.cfg.block.sandwich_norms:
            y = self.norm(y, lw.post_norm)
        return self.g.op1("Add", [x, y])

    def qkv(self, i: int, x: str, lw: LayerWeights) -> str:
        """The attention's input: (N, H) -> packed (N, (Hq + 2*Hkv) * D) [q | k | v] per token,
        one fused projection of the normed residual (q and k in the attention's head layout,
        then normed per head where the family has q/k norms)."""
        g, cfg = self.g, self.cfg
        h = self.norm(x, lw.input_norm)
        wq, wk, bq, bk = lw.wq, lw.wk, lw.bq, lw.bk
        if self.attention is not None and self.attention.layout is not None:
            wq, wk = self.attention.in_layout(wq, cfg.num_heads), self.attention.in_layout(wk, cfg.num_kv_heads)
            if bq is not None and bk is not None:
                bq, bk = self.attention.in_layout(bq, cfg.num_heads), self.attention.in_layout(bk, cfg.num_kv_heads)
        bias = np.concatenate([bq, bk, lw.bv]) if cfg.attention_bias else None  # type: ignore[list-item]
        qkv = g.linear(h, f"l{i}_qkv", np.concatenate([wq, wk, lw.wv], axis=1), bias)
        if self.lora is not None:
            qkv = self.lora.add(qkv, self.lora.fused(i, h, self._qkv_parts()))
        return self.qk_norm(qkv, lw) if cfg.block.qk_norm else qkv

    def _qkv_parts(self) -> list[tuple[str, int, int, np.ndarray | None]]:
        """The fused qkv projection's LoRA parts: q and k columns in the attention's layout."""
        cfg = self.cfg
        h, qw, kw = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q_cols = k_cols = None
        if self.attention is not None and self.attention.layout is not None:
            q_cols = self.attention.in_layout(np.arange(qw), cfg.num_heads)
            k_cols = self.attention.in_layout(np.arange(kw), cfg.num_kv_heads)
        return [("q_proj", h, qw, q_cols), ("k_proj", h, kw, k_cols), ("v_proj", h, kw, None)]

    def qk_norm(self, qkv: str, lw: LayerWeights) -> str:
        """RMSNorm over the D dims of each q and k head of packed (N, (Hq + 2*Hkv) * D)."""
        g, cfg = self.g, self.cfg
        d, qw, kw = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = g.op("Split", [qkv, g.const("split", np.array([qw, kw, kw], np.int64))], 3, axis=-1)
        heads = g.const("shape", np.array([-1, d], np.int64))  # (N * heads, D)
        normed = []
        for x, w, width in ((q, lw.q_norm, qw), (k, lw.k_norm, kw)):
            w = self.attention.in_layout(w, 1) if self.attention is not None else w
            y = self.norm(g.op1("Reshape", [x, heads]), w)
            normed.append(g.op1("Reshape", [y, g.const("shape", np.array([-1, width], np.int64))]))
        return g.op1("Concat", [*normed, v], axis=-1)

    def mlp(self, i: int, x: str, lw: LayerWeights) -> str:
        """x + MLP(norm(x)): the second half of layer ``i`` (with sandwich norms the MLP's
        input norm is pre_feedforward_layernorm and its output is normed too)."""
        sandwich = self.cfg.block.sandwich_norms
        h = self.norm(x, lw.pre_ffn_norm if sandwich else lw.post_norm)
        if self.cfg.is_sparse(i):  # a mixture of experts (moe_graph.py)
            y = moe_mlp(self.g, self.cfg, i, h, lw, self.activation)
        else:
            y = self.dense_mlp(i, h, lw)
        if sandwich:
            y = self.norm(y, lw.post_ffn_norm)
        return self.g.op1("Add", [x, y])

    def dense_mlp(self, i: int, h: str, lw: LayerWeights) -> str:
        """The gated MLP of layer ``i`` on its normed input h (N, H) -> (N, H)."""
        g, cfg = self.g, self.cfg
        # (H, 2 * (I + pad)): [gate | 0 | up | 0]; act(0) * 0 = 0, so the padding columns of the
        # activations are zero and meet zero rows of the down projection: the output is unchanged.
        # (Each LayerWeights attribute reads its tensor: one access per weight.)
        inter, pad = cfg.intermediate_size, _ffn_padding(g.spec, cfg.intermediate_size)
        zeros = np.zeros((cfg.hidden_size, pad), g.spec.act_dtype)
        gate_up = np.concatenate([lw.w_gate, zeros, lw.w_up, zeros], axis=1)
        bias = None
        if cfg.mlp_bias:  # [b_gate | 0 | b_up | 0]
            b_gate, b_up, no_bias = lw.b_gate, lw.b_up, np.zeros(pad, g.spec.act_dtype)
            bias = np.concatenate([b_gate, no_bias, b_up, no_bias])  # type: ignore[list-item]
        width = np.array([inter + pad, inter + pad], np.int64)
        y = g.linear(h, f"l{i}_gate_up", gate_up, bias)
        if self.lora is not None:  # B of gate and up, A of down: I + pad wide (zero padding)
            hid = cfg.hidden_size
            y = self.lora.add(y, self.lora.fused(i, h, [("gate_proj", hid, inter + pad, None),
                                                         ("up_proj", hid, inter + pad, None)]))
        gate, up = g.op("Split", [y, g.const("split", width)], 2, axis=-1)
        w_down = lw.w_down
        if pad:
            w_down = np.concatenate([w_down, np.zeros((pad, cfg.hidden_size), w_down.dtype)])
        x = g.op1("Mul", [self.activation(gate), up])
        y = g.linear(x, f"l{i}_down", w_down, lw.b_down)
        if self.lora is not None:
            y = self.lora.add(y, self.lora.fused(i, x, [("down_proj", inter + pad, cfg.hidden_size, None)]))
        return y

    def activation(self, x: str) -> str:
        """The MLP gate's activation (``ModelArch.hidden_act``), as transformers' ACT2FN."""
        act, g = self.cfg.hidden_act, self.g
        if act == "silu":
            return g.op1("Mul", [x, g.op1("Sigmoid", [x])])
        if act == "relu":
            return g.op1("Relu", [x])
        if act in ("gelu", "gelu_tanh"):  # ONNX Gelu (opset 20): erf, or its tanh approximation
            return g.op1("Gelu", [x], approximate="tanh" if act == "gelu_tanh" else "none")
        raise ValueError(f"hidden_act {act!r}: no ONNX form")


def _io(cfg: ModelArch, spec: GraphSpec) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    act = helper.np_dtype_to_tensor_dtype(spec.act_dtype)
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    v = helper.make_tensor_value_info
    if spec.form == "paged":
        return _paged_io(cfg, act)
    inputs = [v("input_ids", i64, ["N"]), v("pad_index", i64, ["B", "S"]),
              v("unpad_index", i64, ["N"]), v("logits_index", i64, ["R"])]
    if spec.form == "gqa":
        inputs += [v("seqlens_k", i32, ["B"]), v("total_seq_len", i32, []), v("query_seqlens", i32, ["B"])]
    else:
        inputs += [v("position_ids", i64, ["B", "S"]), v("write_indices", i64, ["B"])]
    outputs = [v("logits", TensorProto.FLOAT, ["R", cfg.vocab_size])]
    # canonical: C is the graph's static KV length (TensorRT's KV-cache update needs a static
    # sequence dim; one plan serves one capacity anyway); gqa: symbolic
    capacity: str | int = spec.max_model_len if spec.form == "canonical" else "C"
    _kv_io(cfg, act, ["B", cfg.num_kv_heads, capacity, cfg.head_dim], "past_{kind}_{i}", inputs, outputs)
    return inputs, outputs


def _kv_io(cfg: ModelArch, act: int, shape: list[str | int | None], name: str,
           inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto]) -> None:
    """Each layer's K and V as an input named ``name`` (``{kind}``, ``{i}`` filled in) and as the
    output ``present_{kind}_{i}``, both of ``shape``."""
    v = helper.make_tensor_value_info
    for i in range(cfg.num_layers):
        for kind in ("key", "value"):
            inputs.append(v(name.format(kind=kind, i=i), act, shape))
            outputs.append(v(f"present_{kind}_{i}", act, shape))


def _paged_io(cfg: ModelArch, act: int) -> tuple[list[onnx.ValueInfoProto], list[onnx.ValueInfoProto]]:
    """The paged form's inputs and outputs (module docstring); the pool's sizes are symbolic, so
    one engine serves any ``KVLayout``."""
    i64, i32 = TensorProto.INT64, TensorProto.INT32
    v = helper.make_tensor_value_info
    inputs = [v("input_ids", i64, ["N"]), v("positions", i64, ["N"]), v("slot_mapping", i64, ["N"]),
              v("block_tables", i32, ["B", "W"]), v("seq_lens", i32, ["B"]),
              v("query_start", i32, ["B1"]), v("logits_index", i64, ["R"])]
    outputs = [v("logits", TensorProto.FLOAT, ["R", cfg.vocab_size])]
    _kv_io(cfg, act, ["NB", cfg.num_kv_heads, "BS", cfg.head_dim], "{kind}_cache_{i}", inputs, outputs)
    return inputs, outputs


def _embed(g: _Graph, cfg: ModelArch, weights: ModelWeights) -> str:
    """``input_ids`` (N,) -> their embeddings (N, H), times the family's scale (a constant of
    the activations' type, as transformers multiplies them)."""
    x = g.op1("Gather", [g.weight("embed", weights.embed), "input_ids"], axis=0)
    scale = cfg.block.embed_scale
    return x if scale == 1.0 else g.op1("Mul", [x, g.weight("embed_scale", np.array(scale))])


def _logits(g: _Graph, cfg: ModelArch, weights: ModelWeights, x: str) -> None:
    """(N, H) -> the graph's float32 ``logits`` (R, V) of the rows ``logits_index`` picks,
    soft-capped in float32 where the family caps them: cap * tanh(logits / cap)."""
    x = g.op1("Gather", [x, "logits_index"], axis=0)  # (R, H): only rows that sample
    x = g.rms_norm(x, norm_weight(cfg.block, weights.final_norm), cfg.rms_norm_eps)
    logits = g.linear(x, "lm_head", weights.lm_head) if g.spec.precision == "fp16" else \
        g.op1("MatMul", [x, g.weight("lm_head", weights.lm_head)])
    cap = cfg.block.final_softcap
    if cap is None:
        g.nodes.append(helper.make_node("Cast", [logits], ["logits"], to=TensorProto.FLOAT, name="logits_cast"))
        return
    cap_value = g.const("final_softcap", np.array(cap, np.float32))
    scaled = g.op1("Div", [g.op1("Cast", [logits], to=TensorProto.FLOAT), cap_value])
    g.nodes.append(helper.make_node("Mul", [g.op1("Tanh", [scaled]), cap_value], ["logits"], name="logits_softcap"))


def build_llama_graph(cfg: ModelArch, weights: ModelWeights, spec: GraphSpec,
                      store: InitializerStore | None = None) -> onnx.ModelProto:
    """The whole decoder as one ONNX model (see the module docstring for the I/O contract).

    Weights are read, converted and handed to ``store`` one fused tensor at a time, in graph
    order; with an ``ExternalDataWriter`` the model returned is a skeleton pointing into its
    data file, and the build holds a few times the largest fused tensor, never the model.
    """
    if spec.lora is not None:
        check_lora(cfg, spec)
    g = _Graph(spec, store or InMemoryInitializers())
    layers = _Layers(g, cfg)
    x = _embed(g, cfg, weights)  # (N, H)
    for i, lw in enumerate(weights.layers):
        x = layers.layer(i, x, lw)
    _logits(g, cfg, weights, x)
    inputs, outputs = _io(cfg, spec)
    if layers.lora is not None:
        inputs += layers.lora.inputs
    graph = helper.make_graph(g.nodes, f"inferflow_{cfg.architecture}_{spec.form}", inputs, outputs, g.inits)
    opsets = [helper.make_opsetid("", 24 if spec.form == "canonical" else 21)]
    if spec.cpu:
        opsets.append(helper.make_opsetid("com.microsoft", 1))
    if spec.form == "paged":
        opsets.append(helper.make_opsetid(PAGED_OP_DOMAIN, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=11, producer_name="inferflow",
                             producer_version=GRAPH_BUILDER_VERSION)


def build_llama_segments(cfg: ModelArch, weights: ModelWeights, spec: GraphSpec) -> Iterator[onnx.ModelProto]:
    """The decoder cut at every attention: ``num_layers + 1`` models, one at a time, whose
    attention is computed outside ONNX Runtime, between them (``runtimes/split_decode.py``).
    Each holds its weights in memory; a caller that keeps sessions, not models, holds one
    segment's at a time.

    - segment 0: ``input_ids`` (N,) -> ``x`` (N, H), ``qkv`` (N, (Hq + 2*Hkv) * D) of layer 0;
    - segment i, 0 < i < L: ``x``, ``attn`` (N, Hq * D), layer i - 1's attention output -> the
      rest of layer i - 1 (output projection, MLP), then ``x`` and ``qkv`` of layer i;
    - segment L: ``x``, ``attn``, ``logits_index`` (R,) -> ``logits`` (R, V).
    """
    if spec.form != "gqa":
        raise ValueError("segments are cut from the CPU (gqa) form")
    if spec.lora is not None:
        raise ValueError("segments are cut from graphs without LoRA")
    if (cfg.block != Block() or cfg.layer_windows or cfg.local_rope or cfg.rotary_dim != cfg.head_dim
            or cfg.moe):
        raise ValueError(f"segments are cut from Llama-like decoders only, not {cfg.architecture}'s")
    act = helper.np_dtype_to_tensor_dtype(spec.act_dtype)
    v = helper.make_tensor_value_info
    h, qw = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    for i in range(cfg.num_layers + 1):
        g = _Graph(spec, InMemoryInitializers())
        layers = _Layers(g, cfg, attention=False)
        if i == 0:
            inputs = [v("input_ids", TensorProto.INT64, ["N"])]
            x = _embed(g, cfg, weights)
        else:
            inputs = [v("x", act, ["N", h]), v("attn", act, ["N", qw])]
            lw = weights.layers[i - 1]
            x = layers.mlp(i - 1, layers.attention_out(i - 1, "x", "attn", lw), lw)
        if i < cfg.num_layers:
            qkv = layers.qkv(i, x, weights.layers[i])
            g.nodes += [helper.make_node("Identity", [x], ["x_out"]), helper.make_node("Identity", [qkv], ["qkv"])]
            width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
            outputs = [v("x_out", act, ["N", h]), v("qkv", act, ["N", width])]
        else:
            inputs.append(v("logits_index", TensorProto.INT64, ["R"]))
            _logits(g, cfg, weights, x)
            outputs = [v("logits", TensorProto.FLOAT, ["R", cfg.vocab_size])]
        graph = helper.make_graph(g.nodes, f"inferflow_{cfg.architecture}_segment_{i}", inputs, outputs, g.inits)
        yield helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=11,
                                producer_name="inferflow", producer_version=GRAPH_BUILDER_VERSION)
