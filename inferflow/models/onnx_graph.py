"""The ONNX graph under construction, shared by the decoder builders (``llama_graph``,
``graph_attention``, ``moe_graph``): the build's ``GraphSpec`` and ``_Graph``, which accumulates
nodes and initializers. Imports only ``models/`` leaves (initializers, quantize)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper

from inferflow.models.initializers import InitializerStore
from inferflow.models.quantize import quantize_blocked

if TYPE_CHECKING:
    from inferflow.lora.adapter import LoraSpec

GraphForm = Literal["gqa", "paged", "canonical"]

PAGED_OP_DOMAIN = "inferflow"  # the paged-attention custom op (runtimes/ort_ops/)


@dataclass(frozen=True)
class GraphSpec:
    form: GraphForm = "gqa"
    precision: str = "fp32"  # fp32 | fp16 | bf16 | int8 | int4 (weight-only for int8/int4)
    max_model_len: int = 2048  # rows of the rotary tables; positions must stay below it
    quant_block_size: int = 32
    # MatMulNBits accuracy_level: 0 = float activations (exact dequantized matmul); 4 = int8
    # activations (faster on CPU, ~1e-1 logit error). ORT's DequantizeLinear->MatMul fusion in the
    # canonical form takes it from the session, so the engine sets both to the same value.
    quant_accuracy_level: int = 4
    # multi-LoRA (the CPU forms only): every target projection gains the stacked slots' delta,
    # fed as graph inputs (``llama_graph``'s module docstring); None: the graph without LoRA
    lora: LoraSpec | None = None

    @property
    def cpu(self) -> bool:
        """The CPU forms (``gqa``, ``paged``): ONNX Runtime's contrib ops where they are faster."""
        return self.form != "canonical"

    @property
    def act_dtype(self) -> np.dtype:
        """The activations' (and the KV cache's) element type: float16, bfloat16 (``ml_dtypes``,
        the canonical form only: TensorRT) or float32 (fp32 and the weight-only int forms)."""
        if self.precision == "bf16":
            import ml_dtypes  # onnx's own dependency

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(np.float16 if self.precision == "fp16" else np.float32)


class _Graph:
    """Accumulates nodes and initializers; names are unique by construction. Each initializer
    goes to ``store`` when it is made (streamed to the data file when the store writes one)."""

    def __init__(self, spec: GraphSpec, store: InitializerStore) -> None:
        self.spec, self.store = spec, store
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self._n = 0

    def name(self, base: str) -> str:
        self._n += 1
        return f"{base}_{self._n}"

    def const(self, base: str, value: np.ndarray) -> str:
        name = self.name(base)
        self.inits.append(self.store.add(name, value))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, domain: str = "", **attrs: Any) -> list[str]:
        outs = [self.name(op_type.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(op_type), domain=domain, **attrs))
        return outs

    def op1(self, op_type: str, inputs: list[str], domain: str = "", **attrs: Any) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]

    def weight(self, base: str, w: np.ndarray) -> str:
        return self.const(base, w.astype(self.spec.act_dtype, copy=False))

    def linear(self, x: str, base: str, w: np.ndarray, bias: np.ndarray | None = None) -> str:
        """x (N, K) @ w (K, N_out) [+ bias], in the spec's weight precision."""
        p = self.spec.precision
        if p in ("int8", "int4"):
            qw = quantize_blocked(w, 8 if p == "int8" else 4, self.spec.quant_block_size)
            if self.spec.cpu:
                y = self.op1("MatMulNBits", [x, self.const(base + "_q", qw.matmulnbits_b()),
                                             self.const(base + "_scales", qw.matmulnbits_scales())],
                             domain="com.microsoft", K=qw.k, N=qw.n, bits=qw.bits, block_size=qw.block_size,
                             accuracy_level=self.spec.quant_accuracy_level)
            else:
                qname = self.name(base + "_q")
                self.inits.append(self.store.add(qname, qw.q) if qw.bits == 8 else
                                  self.store.add(qname, qw.int4_packed(), TensorProto.INT4, qw.q.shape))
                deq = self.op1("DequantizeLinear", [qname, self.const(base + "_scales", qw.scales)],
                               axis=0, block_size=qw.block_size)
                y = self.op1("MatMul", [x, deq])
        else:
            y = self.op1("MatMul", [x, self.weight(base, w)])
        return self.op1("Add", [y, self.weight(base + "_bias", bias)]) if bias is not None else y

    def rms_norm(self, x: str, w: np.ndarray, eps: float) -> str:
        op = "RMSNormalization" if self.spec.form == "canonical" else "SimplifiedLayerNormalization"
        return self.op1(op, [x, self.weight("norm", w)], axis=-1, epsilon=eps)
