"""Typed settings of a compiled engine (the ``executor`` config slot fills these)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from inferflow.paths import inferflow_home

PRECISIONS = ("fp32", "fp16", "int8", "int4")
BACKENDS = ("onnxruntime", "tensorrt")
GRAPH_FORMS = ("gqa", "canonical")


def default_engine_dir() -> Path:
    """Where compiled engines are cached: $INFERFLOW_ENGINE_DIR, else $INFERFLOW_HOME/compiled_engines."""
    if env := os.environ.get("INFERFLOW_ENGINE_DIR"):
        return Path(env).expanduser()
    return inferflow_home() / "compiled_engines"


@dataclass(frozen=True)
class EngineConfig:
    """How to build and run the compiled engine.

    ``max_slots`` sequences run at once, each owning ``max_model_len`` token positions of KV in
    its slot; ``num_blocks`` x ``block_size`` tokens is the block pool that backs the prefix cache
    and bounds admitted KV (0 = one full slot's worth of blocks per slot).
    """

    backend: str = "onnxruntime"  # onnxruntime (CPU) | tensorrt (NVIDIA GPU, canonical graph)
    precision: str = "fp32"
    graph_form: str = "gqa"
    max_slots: int = 8
    max_model_len: int = 1024
    block_size: int = 16
    num_blocks: int = 0
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

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"executor.precision: {self.precision!r} is not one of {', '.join(PRECISIONS)}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"executor.backend: {self.backend!r} is not one of {', '.join(BACKENDS)}"
            )
        if self.graph_form not in GRAPH_FORMS:
            raise ValueError(
                f"executor.graph_form: {self.graph_form!r} is not one of {', '.join(GRAPH_FORMS)}"
            )
        if self.max_slots < 1 or self.max_model_len < 2 or self.block_size < 1:
            raise ValueError(
                "executor: max_slots >= 1, max_model_len >= 2 and block_size >= 1 are required"
            )

    @property
    def resolved_num_blocks(self) -> int:
        return self.num_blocks or self.max_slots * -(-self.max_model_len // self.block_size)

    @property
    def engine_dir(self) -> Path:
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_engine_dir()


@dataclass(frozen=True)
class TorchSettings:
    """How to build and run the torch engine (``runtimes/torch_engine``)."""

    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # float32 | bfloat16 | float16
    compile: str = "inductor"  # inductor | eager
    cuda_graphs: bool = True  # CUDA only: replay decode steps from captured graphs
    threads: int = 0  # CPU intra-op threads; 0 = torch's default (one per core)
    cache_dir: str | None = None  # None = default_engine_dir()
