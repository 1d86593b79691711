"""The engine: ``LLMEngine`` (the facade the server and ``LLM`` drive) and its step.

``step.py`` is the three calls of one step (schedule -> execute -> update); the components it
calls are the graph's engine-side stages (``inferflow.stages``): the batching stage's policy
inside ``inferflow.scheduling.Scheduler``, the cache stage's ``KVCacheManager``, the executor
stage (which runs a compiled model from ``inferflow.runtimes``) and the detokenizer stage. It
imports the core and ``stages/``; ``graph/`` builds it and ``llm``/``server/`` drive it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from inferflow.engine.llm_engine import LLMEngine, RequestRejected

__all__ = ["LLMEngine", "RequestRejected"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # lazy: keeps ``import inferflow.engine.step`` light
        from inferflow.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
