"""The frontend's own settings, read from the ``server`` config group.

``ServerSettings.from_config`` accepts the typed ``inferflow.config.ServerConfig``, an OmegaConf
node or a plain mapping, and ignores keys it does not know. API keys are ``server.api_keys`` plus
the comma-separated environment variable named by ``server.api_keys_env`` (default
``INFERFLOW_API_KEYS``); when both are empty the API is open.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from typing import Any

DEFAULT_API_KEYS_ENV = "INFERFLOW_API_KEYS"


@dataclass(frozen=True)
class ServerSettings:
    """Limits and lifecycle knobs of the HTTP frontend. ``None`` disables a limit."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    max_payload_bytes: int | None = 1_048_576
    request_timeout_s: float | None = 600.0  # arrival -> last token; 504 after it
    max_waiting_requests: int | None = 256  # admitted beyond the engine's slots; 429 after it
    rate_limit_requests_per_minute: int | None = None  # per API key (one bucket when open)
    rate_limit_tokens_per_minute: int | None = None  # prompt + max_tokens, per API key
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests may finish for this long
    num_api_servers: int = 1  # uvicorn processes sharing the port
    log_level: str = "info"
    public_metrics: bool = False  # with API keys on, /metrics answers without a key too
    worker_stall_timeout_s: float | None = 10.0  # no engine heartbeat this long: /ready 503
    worker_watchdog_s: float | None = 30.0  # ... this long: kill and restart the worker
    max_connections: int | None = 4096  # open HTTP connections, all API processes together
    timeout_header_s: float | None = 15.0  # waiting for a request's headers; then closed
    timeout_body_s: float | None = 30.0  # receiving a request's body; then 408
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    model_load_timeout_s: float = 300.0  # a request waits this long for its model to load

    @classmethod
    def from_config(cls, cfg: Any, environ: Mapping[str, str] | None = None) -> ServerSettings:
        """Build from the ``server`` config node plus the environment."""
        env = os.environ if environ is None else environ
        keys = [str(k) for k in (_get(cfg, "api_keys") or ())]
        keys_env = str(_get(cfg, "api_keys_env") or DEFAULT_API_KEYS_ENV)
        keys += [k.strip() for k in env.get(keys_env, "").split(",") if k.strip()]
        workers = int(_get(cfg, "workers") or 1)
        if workers != 1:
            raise ValueError(
                "server.workers: one engine worker per model is supported (it owns "
                f"the KV cache and batches every request), got {workers}"
            )
        names = [f.name for f in fields(cls) if f.name != "api_keys"]
        values = {name: _get(cfg, name) for name in names}
        defaults = cls()
        kwargs = {
            k: _plain(v) if v is not None else getattr(defaults, k) for k, v in values.items()
        }
        for name in _NULLABLE:  # an explicit null disables the limit
            if _has(cfg, name):
                kwargs[name] = _plain(values[name])
        settings = cls(**kwargs, api_keys=tuple(dict.fromkeys(keys)))
        settings.validate()
        return settings

    def validate(self) -> None:
        if not 0 <= int(self.port) <= 65535:
            raise ValueError(f"server.port: must be in [0, 65535], got {self.port}")
        if self.num_api_servers < 1:
            raise ValueError(f"server.num_api_servers: must be >= 1, got {self.num_api_servers}")
        for name in _NULLABLE:
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"server.{name}: must be >= 0, got {value}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"server.max_connections: must be >= 1, got {self.max_connections}")
        if self.timeout_keep_alive_s < 0:
            raise ValueError(
                f"server.timeout_keep_alive_s: must be >= 0, got {self.timeout_keep_alive_s}"
            )
        if self.shutdown_grace_s < 0:
            raise ValueError(f"server.shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")


_NULLABLE = (
    "max_payload_bytes",
    "request_timeout_s",
    "max_waiting_requests",
    "rate_limit_requests_per_minute",
    "rate_limit_tokens_per_minute",
    "max_connections",
    "timeout_header_s",
    "timeout_body_s",
)


def _has(cfg: Any, name: str) -> bool:
    if cfg is None:
        return False
    return name in cfg if isinstance(cfg, Mapping) else hasattr(cfg, name)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, Enum) else value


def _get(cfg: Any, name: str) -> Any:
    """``cfg.name`` for a dataclass/object, ``cfg[name]`` for a mapping/DictConfig; else None."""
    if cfg is None:
        return None
    if isinstance(cfg, Mapping):
        return cfg.get(name)
    return getattr(cfg, name, None)
