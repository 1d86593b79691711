"""The CPU graph pads a 4 KiB-row MLP intermediate (``llama_graph._ffn_padding``) and nothing else.

That the padded engine's tokens and logits equal transformers' is the oracle test's
``ffn1024`` checkpoint; this pins which graphs are padded and that the padding is zeros.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import numpy_helper

from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.llama_graph import GraphSpec, build_llama_graph
from inferflow.models.tiny import make_checkpoint


@pytest.mark.parametrize(
    ("intermediate", "form", "precision", "rows"),
    [
        (1024, "gqa", "fp32", 1056),  # 4 KiB rows in fp32: padded
        (2048, "gqa", "fp16", 2080),  # 4 KiB rows in fp16: padded
        (1024, "gqa", "fp16", 1024),  # 2 KiB rows: left alone
        (384, "gqa", "fp32", 384),
        (1024, "gqa", "int8", 1024),  # MatMulNBits quantizes the activations to its own buffer
        (1024, "canonical", "fp32", 1024),  # the TensorRT form
    ],
)
def test_the_down_projection_is_padded_only_for_4k_rows_on_cpu(
    tmp_path: Path, intermediate: int, form: str, precision: str, rows: int
) -> None:
    ck = load_checkpoint(make_checkpoint(tmp_path / "m", num_layers=1, hidden_size=64, num_heads=4,
                                         num_kv_heads=2, intermediate_size=intermediate))
    with ck.open_weights(np.float16 if precision == "fp16" else np.float32) as weights:
        model = build_llama_graph(ck.config, weights, GraphSpec(form, precision, 64))  # type: ignore[arg-type]
    inits = {t.name.rsplit("_", 1)[0]: t for t in model.graph.initializer}
    if precision == "int8":
        down_node = next(n for n in model.graph.node if n.op_type == "MatMulNBits" and "l0_down" in n.input[1])
        assert next(a.i for a in down_node.attribute if a.name == "K") == rows
        return
    down = numpy_helper.to_array(inits["l0_down"])
    gate_up = numpy_helper.to_array(inits["l0_gate_up"])
    assert down.shape == (rows, 64) and gate_up.shape == (64, 2 * rows)
    assert not down[intermediate:].any()
    assert not gate_up[:, intermediate:rows].any() and not gate_up[:, rows + intermediate:].any()
