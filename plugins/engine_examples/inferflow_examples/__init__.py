"""inferflow plugin: small, complete examples of engine-side and response-side stages, and of
chat-aware ones."""

from inferflow_examples.chat import ChatFooter, OperatorSystemPrompt
from inferflow_examples.components import (
    ShortestPromptFirst,
    ShoutingResponse,
    StepCountingExecutor,
)

__all__ = [
    "ChatFooter",
    "OperatorSystemPrompt",
    "ShortestPromptFirst",
    "ShoutingResponse",
    "StepCountingExecutor",
]
