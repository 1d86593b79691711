"""An application builder for Ray Serve's own tooling: ``serve run``, ``serve deploy`` and
KubeRay's ``RayService`` (``serveConfigV2``: ``import_path: inferflow.server.ray.app:build``).

``args.overrides`` is the same list of Hydra overrides as ``python -m inferflow``'s command line
(``server=ray`` is implied)::

    serve run inferflow.server.ray.app:build 'overrides=["server.num_replicas=2"]'

The cluster, Serve's HTTP options and the app's lifetime then belong to that tooling; ``python
-m inferflow server=ray`` (``host.serve_on_ray``) is the standalone way that owns them itself.
"""

from __future__ import annotations

import json
from typing import Any


def build(args: dict[str, Any]) -> Any:
    """The Serve ``Application`` of the graph composed from ``args["overrides"]``."""
    from inferflow.compose import compose_config
    from inferflow.graph import build_graph
    from inferflow.server.ray.host import build_app

    overrides = args.get("overrides") or []
    if isinstance(overrides, str):  # `serve run ... overrides=[...]` passes a string
        overrides = json.loads(overrides)
    if not any(o.startswith("server=") for o in overrides):
        overrides = ["server=ray", *overrides]
    graph = build_graph(compose_config(overrides))
    graph.check_engine_settings()
    app, _ = build_app(graph)
    return app
