"""The serving graph (moved here from ``inferflow/graph.py``)."""

from inferflow.graph.build import *  # noqa: F403
from inferflow.graph.build import ServingGraph, build_graph, splice_order, typed_config  # noqa: F401
