"""Build a Llama engine's ONNX graph by streaming the checkpoint, tensor by tensor.

Each weight is read from the safetensors files (``ModelWeights``), converted or quantized
(``llama_graph``) and appended to the entry's ``model.onnx.data`` (``ExternalDataWriter``)
before the next one is read, so the build's memory is a few times the largest fused tensor in
fp32 (its sources, the fused tensor, one quantization temporary) plus the graph skeleton,
whatever the model's size. Weights are read as float16 for an fp16 engine (an F16
checkpoint is never widened) and as float32 otherwise; a bf16 or fp16 checkpoint is widened one
tensor at a time, never whole.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx

from inferflow.models.checkpoint import Checkpoint
from inferflow.models.initializers import ExternalDataWriter
from inferflow.models.llama_graph import GraphSpec, build_llama_graph
from inferflow.runtimes.build_progress import BuildProgress


def build_llama_engine(checkpoint: Checkpoint, spec: GraphSpec, folder: Path) -> onnx.ModelProto:
    """The graph for ``spec``, its weights written to ``folder/model.onnx.data`` as they come."""
    dtype = np.float16 if spec.precision == "fp16" else np.float32
    label = f"building {spec.form}/{spec.precision} engine of {checkpoint.name}"
    with checkpoint.open_weights(dtype) as weights, BuildProgress.of(weights, label):
        writer = ExternalDataWriter(folder)
        try:
            return build_llama_graph(checkpoint.config, weights, spec, writer)
        finally:
            writer.close()
