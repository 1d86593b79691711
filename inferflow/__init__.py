"""inferflow: a declarative, config-driven LLM inference server.

``from inferflow import LLM, SamplingParams`` is the offline API (vLLM-style).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from inferflow.sampling_params import RequestOutputKind, SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from inferflow.llm import LLM


def __getattr__(name: str) -> Any:
    if name == "LLM":  # lazy: importing inferflow must stay cheap (no onnxruntime import)
        from inferflow.llm import LLM

        return LLM
    raise AttributeError(name)
