"""inferflow: a declarative, config-driven LLM inference server.

``from inferflow import LLM, SamplingParams`` is the offline API (vLLM-style); ``LLM`` is
imported on first use, so importing the package stays cheap. The layers, bottom up, each
importing only the ones below it (``tests/test_layers.py``): ``paths``, ``json_types``, ``interrupts`` ->
``config/`` -> ``sampling_params``, ``outputs`` -> ``models/`` -> ``scheduling/`` -> ``sampling/``
-> ``runtimes/`` -> ``stages/`` -> ``engine/``, ``compose`` -> ``graph/`` -> ``llm``,
``embeddings/``, ``telemetry/`` -> ``server/`` -> ``cli``; ``testing/`` and ``bench/`` on top.
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
