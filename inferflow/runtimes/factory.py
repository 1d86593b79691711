"""Pick the compiled-engine runtime named by ``EngineConfig.backend``."""

from __future__ import annotations

from typing import Any

from inferflow.models.checkpoint import Checkpoint
from inferflow.runtimes.config import EngineConfig


def create_runner(checkpoint: Checkpoint, config: EngineConfig) -> Any:
    """An engine with ``forward``, ``load_blocks``, ``save_blocks``, ``num_slots``, ``capacity``."""
    if config.backend == "tensorrt":
        from inferflow.runtimes.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(checkpoint, config)
    from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner

    return OnnxRuntimeRunner(checkpoint, config)
