"""Embedding models, all in one package.

- ``service``: the offline ``Embedder`` and the ``EmbeddingService`` the server calls;
- ``encoder_runner``: the compiled BERT-family encoder (ONNX Runtime);
- ``dynamic_batcher``: the batching window that groups one-shot requests;
- ``models``: which embedding models a graph hosts (``EmbeddingModelSpec``).

The HTTP half (``/v1/embeddings``, version routing, spans, the embedding-only server) lives in
``inferflow.server``; this package is the engine side: it imports ``config/``, ``models/``,
``runtimes/``, ``stages/`` and ``graph/``'s repository, and nothing of ``server/``.

``from inferflow.embeddings import Embedder, EmbeddingService, EmbeddingInputError,
EmbeddingResult`` keeps working (loaded on first use: importing the package stays cheap).
"""

from __future__ import annotations

from typing import Any

_SERVICE_NAMES = ("Embedder", "EmbeddingInputError", "EmbeddingResult", "EmbeddingService")
__all__ = list(_SERVICE_NAMES)


def __getattr__(name: str) -> Any:
    if name in _SERVICE_NAMES:
        from inferflow.embeddings import service

        return getattr(service, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
