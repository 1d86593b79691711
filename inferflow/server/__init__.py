"""The server, grouped by the process each part runs in (see docs/architecture.md):

- ``http/`` — the API processes: OpenAI routes (``frontend``), request and response stages
  (``pipeline``, ``response_pipeline``), protocol, limits, errors, SSE, ops routes;
- ``worker/`` — the engine worker: the LitAPI that owns the engine (``api``), the engine loop
  (``loop``) and its inbox/outbox (``queues``);
- ``process/`` — the main process and lifecycle: ``runtime.serve`` (what ``python -m inferflow``
  runs), the LitServer subclass, the supervisor, the shared state between processes;
- ``messages`` (what crosses processes) and ``observability`` (telemetry of both sides).
"""

from __future__ import annotations

from typing import Any


def serve(graph: Any) -> None:
    """Serve ``graph`` until SIGTERM/SIGINT; see ``inferflow.server.process.runtime.serve``."""
    from inferflow.server.process.runtime import serve as _serve

    _serve(graph)
