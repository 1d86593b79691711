"""Typed settings of the model runners (the ``executor`` stages fill these; the sizes are the
engine's ``KVLayout``, passed beside them: ``Runner(checkpoint, settings, layout)``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from inferflow.config.base import ConfigEnum
from inferflow.paths import inferflow_home


class Precision(ConfigEnum):
    """Weight precision of the compiled engine (int8/int4: weight-only quantization, float32
    activations). ``bf16`` is TensorRT's (ONNX Runtime's CPU kernels have no bfloat16 MatMul);
    ``int8`` is ONNX Runtime's (TensorRT quantizes int8 weights only together with int8
    activations). Each executor refuses the ones it does not run (``precisions``)."""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    int8 = "int8"
    int4 = "int4"


class GraphForm(ConfigEnum):
    """``paged``: the CPU graph over a paged KV pool (``inferflow::PagedAttention``, a custom op
    built on this machine: ``runtimes/ort_ops``); ``gqa``: ONNX Runtime's GroupQueryAttention
    over slot buffers (CPU); ``canonical``: standard ops over slot buffers (TensorRT, the
    reference); ``auto``: ``paged`` where the op builds, else ``gqa``."""

    auto = "auto"
    paged = "paged"
    gqa = "gqa"
    canonical = "canonical"


def default_engine_dir() -> Path:
    """Where compiled engines are cached: $INFERFLOW_ENGINE_DIR, else $INFERFLOW_HOME/compiled_engines."""
    if env := os.environ.get("INFERFLOW_ENGINE_DIR"):
        return Path(env).expanduser()
    return inferflow_home() / "compiled_engines"


@dataclass(frozen=True)
class OrtSettings:
    """How to build and run the ONNX graph (ONNX Runtime, or TensorRT over the canonical graph).
    The sizes are the engine's frozen ``KVLayout``, given beside these settings; the executor
    stage checked the values (``precision`` a :class:`Precision`, ``graph_form`` a
    :class:`GraphForm`)."""

    precision: str = "fp32"
    graph_form: str = "gqa"
    intra_op_threads: int = 0  # 0 = onnxruntime's default (one per core)
    inter_op_threads: int = 1
    allow_spinning: bool = True  # ORT's pool threads spin between the ops of a call, not after it
    cache_dir: str | None = None  # None = default_engine_dir()
    quant_block_size: int = 32
    quant_accuracy_level: int = 4  # int8/int4: 0 = float activations, 4 = int8 activations (faster)
    device_id: int = 0  # GPU for the tensorrt backend
    # the scheduler's token budget per step (batching.max_num_batched_tokens): sizes the
    # TensorRT optimization profiles; 0 = unknown (profiles for chunks of up to 2048 tokens)
    max_num_batched_tokens: int = 0

    @property
    def engine_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_engine_dir()


@dataclass(frozen=True)
class TorchSettings:
    """How to build and run the torch engine (``runtimes/torch_engine/``)."""

    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 | float16
    compile: str = "inductor"  # inductor | eager
    cuda_graphs: bool = True  # CUDA only: replay decode steps from captured graphs
    threads: int = 0  # CPU intra-op threads; 0 = torch's default (one per core)
    cache_dir: str | None = None  # None = default_engine_dir()
