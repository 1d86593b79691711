"""Moved: ``inferflow.engine.llm_engine`` (this path keeps working, with a FutureWarning)."""

import warnings

from inferflow.engine.llm_engine import LLMEngine, RequestRejected

__all__ = ["LLMEngine", "RequestRejected"]

warnings.warn(
    "inferflow.llm_engine moved to inferflow.engine.llm_engine (or: from inferflow.engine "
    "import LLMEngine)",
    FutureWarning,
    stacklevel=2,
)
