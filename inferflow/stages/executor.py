"""The ``executor`` slot: which compiled engine runs the model, and how.

``executor=onnxruntime`` (CPU, the default) or ``executor=tensorrt`` (NVIDIA GPU, optional
extra). The fields become ``inferflow.engines.config.EngineConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from inferflow.stages.base import ConfigEnum
from inferflow.stages.engine_slot import EngineSlot, EngineSpec


class Precision(ConfigEnum):
    """Weight precision of the compiled engine (int8/int4: weight-only quantization)."""

    fp32 = "fp32"
    fp16 = "fp16"
    int8 = "int8"
    int4 = "int4"


class GraphForm(ConfigEnum):
    """``gqa``: ONNX Runtime's GroupQueryAttention graph (CPU); ``canonical``: standard ops."""

    gqa = "gqa"
    canonical = "canonical"


@dataclass
class OnnxRuntimeExecutor(EngineSlot):
    """ONNX Runtime on CPU. ``intra_op_threads=0`` lets ONNX Runtime pick (one per core);
    ``max_slots`` (sequences resident at once) defaults to the batching slot's batch size;
    ``cache_dir`` (compiled engines) defaults to ``$INFERFLOW_ENGINE_DIR`` or
    ``$INFERFLOW_HOME/compiled_engines``."""

    kind: ClassVar[str] = "executor"
    backend: ClassVar[str] = "onnxruntime"
    precision: Precision = Precision.fp32
    graph_form: GraphForm = GraphForm.gqa
    intra_op_threads: int = 0
    inter_op_threads: int = 1
    allow_spinning: bool = False
    max_slots: int | None = None
    cache_dir: str | None = None
    quant_block_size: int = 32
    quant_accuracy_level: int = 4  # int8/int4 MatMulNBits: 0 = float activations, 4 = int8 (faster)

    def __post_init__(self) -> None:
        if self.intra_op_threads < 0 or self.inter_op_threads < 0:
            raise ValueError(
                "intra_op_threads / inter_op_threads: must be >= 0 (0 = runtime default)"
            )
        if self.max_slots is not None and self.max_slots < 1:
            raise ValueError(f"max_slots: must be >= 1, got {self.max_slots}")
        if self.quant_block_size < 1:
            raise ValueError(f"quant_block_size: must be >= 1, got {self.quant_block_size}")
        if self.quant_accuracy_level not in (0, 1, 2, 3, 4):
            raise ValueError(f"quant_accuracy_level: must be 0..4, got {self.quant_accuracy_level}")

    def contribute(self, spec: EngineSpec) -> None:
        spec.backend = self.backend
        spec.engine.update(
            precision=Precision(self.precision).value,
            graph_form=GraphForm(self.graph_form).value,
            intra_op_threads=self.intra_op_threads,
            inter_op_threads=self.inter_op_threads,
            allow_spinning=self.allow_spinning,
            cache_dir=self.cache_dir,
            quant_block_size=self.quant_block_size,
            quant_accuracy_level=self.quant_accuracy_level,
        )
        if self.max_slots is not None:
            spec.shared["max_slots"] = self.max_slots


@dataclass
class TensorRTExecutor(OnnxRuntimeExecutor):
    """TensorRT on an NVIDIA GPU (``pip install inferflow[tensorrt]``). TensorRT's ONNX parser
    needs the standard-op graph, so ``graph_form`` must be ``canonical``."""

    backend: ClassVar[str] = "tensorrt"
    precision: Precision = Precision.fp16
    graph_form: GraphForm = GraphForm.canonical
    device_id: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if GraphForm(self.graph_form) is not GraphForm.canonical:
            raise ValueError(
                "graph_form: tensorrt needs 'canonical' (its parser ignores op domains)"
            )
        if self.device_id < 0:
            raise ValueError(f"device_id: must be >= 0, got {self.device_id}")

    def contribute(self, spec: EngineSpec) -> None:
        super().contribute(spec)
        spec.backend_options["device_id"] = self.device_id
