"""Multi-LoRA in the CPU graph forms (``GraphSpec.lora``; ``inferflow.lora``), emitted by
``llama_graph``'s layers.

With S = max_loras slots of rank R, SR = S * R, the graph also takes
  lora_mask  (N, SR)  each packed token's adapter scaling on its slot's R columns, 0 elsewhere
                      (a base-model token, the paged form's padding: all 0)
  lora_a_{t}_{i} (d_in, SR), lora_b_{t}_{i} (SR, d_out) for each layer i and target t of
                      ``LoraSpec.targets`` (PEFT's ``q_proj`` ... ``down_proj``), the slots'
                      stacked A and B (slot s: columns / rows [s*R, (s+1)*R), zero where empty)
all of the activations' type, and adds ``((x @ A) * lora_mask) @ B`` to each target's output.
The fused projections take the three (two) deltas concatenated: q, k, v before the q/k norms (B's
q and k columns permuted into the attention's head layout by the graph, where it has one); gate
and up with the MLP's zero padding (``_ffn_padding``): there d_out of gate and up, and d_in of
down, are the padded width I + pad, whose last pad columns (rows) the runner keeps zero. The
runners allocate these buffers from the session's input shapes (``runtimes/ort_lora.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from onnx import helper

from inferflow.models.config import ModelArch
from inferflow.models.onnx_graph import GraphSpec, _Graph

if TYPE_CHECKING:
    from inferflow.lora.adapter import LoraSpec

MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class LoraDeltas:
    """Emits the multi-LoRA deltas of the target projections (module docstring) and collects
    the graph inputs they read: ``lora_mask`` first, then each layer's A and B in the order the
    layers use them."""

    def __init__(self, g: _Graph, spec: LoraSpec) -> None:
        self.g, self.targets = g, set(spec.targets)
        self.width = spec.max_loras * spec.max_lora_rank  # SR
        self.act = helper.np_dtype_to_tensor_dtype(g.spec.act_dtype)
        self.inputs = [helper.make_tensor_value_info("lora_mask", self.act, ["N", self.width])]

    def delta(self, i: int, target: str, x: str, d_in: int, d_out: int,
              columns: np.ndarray | None = None) -> str:
        """((x @ A) * mask) @ B of layer ``i``'s ``target``: x (N, d_in) -> (N, d_out); B's
        columns taken in the order ``columns`` (a permutation) when given."""
        g, v = self.g, helper.make_tensor_value_info
        a, b = f"lora_a_{target}_{i}", f"lora_b_{target}_{i}"
        self.inputs += [v(a, self.act, [d_in, self.width]), v(b, self.act, [self.width, d_out])]
        if columns is not None:
            b = g.op1("Gather", [b, g.const("lora_columns", columns.astype(np.int64))], axis=1)
        return g.op1("MatMul", [g.op1("Mul", [g.op1("MatMul", [x, a]), "lora_mask"]), b])

    def fused(self, i: int, x: str, parts: list[tuple[str, int, int, np.ndarray | None]]) -> str | None:
        """The delta of a fused projection of x (N, d_in): ``parts`` (target, d_in, d_out,
        B's column order or None) in column order; a part LoRA does not target is zeros.
        None when it targets none of them."""
        if not any(t in self.targets for t, *_ in parts):
            return None
        g, deltas = self.g, []
        for target, d_in, d_out, columns in parts:
            if target in self.targets:
                deltas.append(self.delta(i, target, x, d_in, d_out, columns))
            else:  # (N, d_out) zeros
                rows = g.op1("Shape", [x], start=0, end=1)
                shape = g.op1("Concat", [rows, g.const("shape", np.array([d_out], np.int64))], axis=0)
                zero = helper.make_tensor("zero", self.act, [1], [0])
                deltas.append(g.op1("ConstantOfShape", [shape], value=zero))
        return deltas[0] if len(deltas) == 1 else g.op1("Concat", deltas, axis=-1)

    def add(self, y: str, delta: str | None) -> str:
        return y if delta is None else self.g.op1("Add", [y, delta])


def check_lora(cfg: ModelArch, spec: GraphSpec) -> None:
    """Refuse a LoRA spec the graph cannot serve (one line): the canonical (TensorRT) form, a
    target outside the projections, MLP targets of a model with sparse (MoE) layers."""
    lora = spec.lora
    if lora is None:
        return
    if not spec.cpu:
        raise ValueError(f"multi-LoRA needs a CPU graph form (gqa, paged), not {spec.form}")
    known = ("q_proj", "k_proj", "v_proj", "o_proj", *MLP_TARGETS)
    if unknown := [t for t in lora.targets if t not in known]:
        raise ValueError(f"LoRA targets {unknown}: not a projection of {cfg.architecture}")
    sparse = [i for i in range(cfg.num_layers) if cfg.is_sparse(i)]
    if sparse and (mlp := [t for t in lora.targets if t in MLP_TARGETS]):
        raise ValueError(f"LoRA targets {mlp}: layers {sparse} are sparse (MoE); target the "
                         "attention projections only")
