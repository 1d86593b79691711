"""The serving graph: from a composed config to the stages and the engine they assemble.

- ``build.py``: ``build_graph(cfg)`` -> ``ServingGraph`` (the stages, the KV layout, the engine);
- ``targets.py``: the ``_target_`` allowlist and building one stage from its node;
- ``order.py``: where each stage runs (request order, which side of the engine);
- ``repository.py``: the model repository (``models:``), one graph config per served model.

It imports ``config/``, ``compose`` (installed plugins) and the stage contracts; the engine and
the checkpoint are imported lazily, when a graph loads them.
"""

from inferflow.graph.build import ServingGraph, build_entry_graph, build_graph
from inferflow.graph.order import place_stages, splice_order

__all__ = ["ServingGraph", "build_entry_graph", "build_graph", "place_stages", "splice_order"]
