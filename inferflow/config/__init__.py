"""The user-facing config schemas (moved here from ``inferflow/config.py``)."""

from inferflow.config.schema import *  # noqa: F403
from inferflow.config.schema import (  # noqa: F401
    BUILTIN_OPTIONS,
    CONF_PACKAGE,
    CONF_SOURCE,
    CONFIG_NAME,
    ENGINE_SLOTS,
    REQUEST_SLOTS,
    SLOTS,
    ConfigError,
    InferflowConfig,
    LoadMode,
    ModelConfig,
    ModelEntryConfig,
    ModelTask,
    OfflineConfig,
    Plugin,
    Task,
    describe_omegaconf_error,
    discover_plugins,
    env_search_paths,
    register_configs,
    stage_schema,
)
