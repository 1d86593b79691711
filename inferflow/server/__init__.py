"""The server, grouped by the process each part runs in (see docs/architecture.md). The top
of the product: it may import everything below it (``graph/``, ``engine/``, ``embeddings/``,
``telemetry/``, ``config/``, ...) and only ``cli`` imports it. Inside, imports run from the root
modules up to ``http/`` and ``worker/``, then to ``process/`` and the hosts:

- the root: what crosses processes (``messages``, ``shared_state``, ``process_utils``), the
  version router (``routing``), the telemetry of both sides (``observability``) and the LoRA
  adapters a model's processes share (``lora``);
- ``http/`` — the API processes: OpenAI and embeddings routes (``frontend``, ``embeddings``),
  request and response stages (``pipeline``, ``response_pipeline``), protocol, limits, errors,
  SSE, ops routes;
- ``worker/`` — the engine worker: ``WorkerService`` (owns the engine), the engine loop
  (``loop``) and its inbox/outbox (``queues``);
- ``process/`` — the main process and lifecycle: what every host builds from a graph
  (``runtime``), the supervisor, model management, the embedding-only server;
- ``litserve/`` and ``ray/`` — the two hosts (``litserve.build.serve`` is what ``python -m
  inferflow`` runs); only ``litserve/`` imports ``litserve``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from inferflow.graph import ServingGraph


def serve(graph: ServingGraph) -> int | None:
    """Serve ``graph`` until SIGTERM/SIGINT (returns that signal); see
    ``inferflow.server.litserve.build.serve``."""
    from inferflow.server.litserve.build import serve as _serve

    return _serve(graph)
