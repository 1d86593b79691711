"""inferflow plugin: small, complete examples of engine-side and response-side stages."""

from inferflow_examples.components import (
    ShortestPromptFirst,
    ShoutingResponse,
    StepCountingExecutor,
)

__all__ = ["ShortestPromptFirst", "ShoutingResponse", "StepCountingExecutor"]
