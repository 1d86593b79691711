"""Load generator for OpenAI-compatible servers, metric-compatible with ``vllm bench serve``.

Command line: ``python -m inferflow.bench`` (also ``inferflow bench``), see
:func:`inferflow.bench.cli.main`. Metric definitions: :mod:`inferflow.bench.metrics` and
``docs/benchmarks.md``. A client of the HTTP API: it imports nothing of inferflow but
``paths`` (the deprecated ``fake_server`` path forwards to ``testing/``), and nothing in the
product imports it (``cli`` runs it by name).
"""

from inferflow.bench.client import EndpointSpec, send_request
from inferflow.bench.datasets import DatasetConfig, build_dataset
from inferflow.bench.metrics import compute_metrics
from inferflow.bench.records import RequestRecord, SampleRequest
from inferflow.bench.runner import LoadConfig, RunOutput, run_load, run_load_sync

__all__ = [
    "DatasetConfig",
    "EndpointSpec",
    "LoadConfig",
    "RequestRecord",
    "RunOutput",
    "SampleRequest",
    "build_dataset",
    "compute_metrics",
    "run_load",
    "run_load_sync",
    "send_request",
]
