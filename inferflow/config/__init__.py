"""The user-facing config schemas and the utilities they share. A leaf package: it imports
nothing of inferflow but ``inferflow.paths`` (``tests/config/test_config_leaf.py`` checks it).

- ``base.py``: ``ConfigEnum``, ``ConfigError``, ``typed_config`` (a node checked against a
  dataclass), one-line OmegaConf errors, memory sizes (``4GiB``, ``auto/N``);
- ``schema.py``: the root ``InferflowConfig``, ``ModelConfig``, a ``models:`` entry, and the
  one ``SLOTS`` table every slot list is derived from;
- ``server.py``: the ``server`` group (``ServerConfig``, ``RayServerConfig``);
- ``tracing.py``: the ``tracing`` group (``TracingConfig``).

Composing the config (Hydra, plugins, the command line) is ``inferflow.compose``; building the
serving graph from it is ``inferflow.graph``.
"""

from inferflow.config.base import (
    ConfigEnum,
    ConfigError,
    describe_omegaconf_error,
    stage_schema,
    typed_config,
)
from inferflow.config.schema import (
    ENGINE_SLOTS,
    REQUEST_SLOTS,
    RESPONSE_SLOTS,
    SLOTS,
    ExperimentConfig,
    InferflowConfig,
    LoadMode,
    ModelConfig,
    ModelEntryConfig,
    ModelTask,
    OfflineConfig,
    Task,
    WorkloadConfig,
)
from inferflow.config.server import LogLevel, RayServerConfig, ServerConfig, ServerRuntime
from inferflow.config.tracing import OtlpProtocol, TracingConfig, TracingExporter

__all__ = [
    "ENGINE_SLOTS", "REQUEST_SLOTS", "RESPONSE_SLOTS", "SLOTS", "ConfigEnum", "ConfigError", "ExperimentConfig",
    "InferflowConfig",
    "LoadMode", "LogLevel", "ModelConfig", "ModelEntryConfig", "ModelTask", "OfflineConfig",
    "OtlpProtocol", "RayServerConfig", "ServerConfig", "ServerRuntime", "Task", "TracingConfig",
    "TracingExporter", "WorkloadConfig", "describe_omegaconf_error", "stage_schema", "typed_config",
]
