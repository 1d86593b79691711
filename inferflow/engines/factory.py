"""Pick the compiled-engine runtime named by ``EngineConfig.backend``."""

from __future__ import annotations

from typing import Any

from inferflow.engines.config import EngineConfig
from inferflow.models.checkpoint import Checkpoint


def create_model_engine(checkpoint: Checkpoint, config: EngineConfig) -> Any:
    """An engine with ``forward``, ``load_blocks``, ``save_blocks``, ``num_slots``, ``capacity``."""
    if config.backend == "tensorrt":
        from inferflow.engines.tensorrt_engine import TensorRTEngine

        return TensorRTEngine(checkpoint, config)
    from inferflow.engines.onnxruntime_engine import OnnxRuntimeEngine

    return OnnxRuntimeEngine(checkpoint, config)
