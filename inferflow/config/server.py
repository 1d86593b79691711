"""Typed schemas of the ``server`` config group: ``server=default`` (LitServe, one machine) and
``server=ray`` (the same graph on Ray Serve). Pure dataclasses: importing this never imports ray.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from inferflow.config.base import ConfigEnum, parse_memory
from inferflow.config.tunable import tunable

API_KEYS_ENV = "INFERFLOW_API_KEYS"
ADMIN_KEYS_ENV = "INFERFLOW_ADMIN_KEYS"


class ServerRuntime(ConfigEnum):
    litserve = "litserve"  # one machine: API processes, queue process, engine worker
    ray = "ray"  # Ray Serve: an ingress deployment and engine replicas (``inferflow[ray]``)


class LogLevel(ConfigEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class RayProxyLocation(ConfigEnum):
    EveryNode = "EveryNode"  # Ray Serve's default: an HTTP proxy on every node
    HeadOnly = "HeadOnly"  # one proxy, on the head node (several nodes sharing one host)


class RayHttpProxy(ConfigEnum):
    auto = "auto"  # HAProxy where its binary is found (the ray extra installs it), else Serve's
    haproxy = "haproxy"  # Ray Serve's high-throughput mode: HAProxy before the ingress replicas
    serve = "serve"  # Serve's Python proxy actor, Serve's stock settings


class RayRouting(ConfigEnum):
    prefix_aware = "prefix_aware"  # a shared prompt prefix goes to the replica that cached it
    power_of_two = "power_of_two"  # Ray Serve's default: the less loaded of two random replicas


@dataclass
class ServerConfig:
    """The HTTP frontend: its address, limits and lifecycle knobs. ``None`` disables a limit.

    ``api_keys`` (plus the comma-separated ``$INFERFLOW_API_KEYS``: ``with_env_api_keys()``,
    which the frontend runs with) turn on bearer-token auth, for every route but ``/health`` and
    ``/ready`` (``public_metrics`` opens ``/metrics``); with none the API is open. ``admin_keys``
    (plus ``$INFERFLOW_ADMIN_KEYS``) are the only keys the admin routes (``/admin/*``: stats,
    canary traffic, promotion) accept once any key is configured: an API key there is a 403,
    and with ``api_keys`` but no ``admin_keys`` the admin routes refuse every key. An admin key
    also opens every other route. With no key of either kind everything is open (the server
    binds 127.0.0.1 by default). Rate limits are per key and per minute (429 + Retry-After). ``num_api_servers``: uvicorn processes
    sharing the port; ``workers``: engine workers per model (one: it owns the KV cache and
    batches every request).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)
    admin_keys: list[str] = field(default_factory=list)  # the admin routes' keys (see above)
    max_payload_bytes: int | None = 1_048_576
    request_timeout_s: float | None = 600.0  # arrival -> last token; 504 after it
    max_waiting_requests: int | None = 256  # admitted beyond the engine's slots; 429 after it
    # /v1/completions prompts x n (or best_of): engine requests one HTTP request may fan out into
    max_choices_per_request: int = 64
    rate_limit_requests_per_minute: int | None = None
    rate_limit_tokens_per_minute: int | None = None
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests may finish for this long
    num_api_servers: int = tunable(1, low=1, high=4, simulated=False,
                                   note="uvicorn processes: HTTP and streaming off the engine's cores")
    workers: int = 1
    log_level: LogLevel = LogLevel.info
    public_metrics: bool = False  # with api_keys: serve /metrics without a key (for scrapers)
    runtime: ServerRuntime = ServerRuntime.litserve  # server=ray selects the Ray Serve host
    worker_stall_timeout_s: float | None = 10.0  # no engine heartbeat this long: /ready 503
    worker_watchdog_s: float | None = 30.0  # ... this long: the worker is killed and restarted
    max_connections: int | None = 4096  # all API processes together; idle ones evicted first
    timeout_header_s: float | None = 15.0  # a connection waiting for request headers: closed
    timeout_body_s: float | None = 30.0  # a request body still arriving: 408
    timeout_keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    # the model repository (``models:``): LLM engine workers together may hold this much
    # memory (bytes, or "512MB" / "4GiB"); loading an on-demand model beyond it first unloads
    # the least recently used idle on-demand model. null: no budget
    model_memory_budget: str | None = None
    model_load_timeout_s: float = 300.0  # a request waits this long for its model to load

    def describe_host(self) -> str:
        """What serves the graph, for ``task=check`` (empty: the single-machine server)."""
        return ""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")
        for name in ("num_api_servers", "workers", "max_choices_per_request"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        for f in dataclasses.fields(self):  # every limit, timeout and size: >= 0 (or null: off)
            value = getattr(self, f.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                null = " or null" if "None" in str(f.type) else ""
                raise ValueError(f"{f.name}: must be >= 0{null}, got {value}")
        for name in ("api_keys", "admin_keys"):  # (a key in both lists is fine)
            if any(not str(key) for key in getattr(self, name)):
                raise ValueError(f"{name}: an empty key would match no client; remove it")
        if self.workers != 1:
            raise ValueError(
                "workers: one engine worker per model is supported (it owns the KV cache and "
                f"batches every request), got {self.workers}"
            )
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {self.max_connections}")
        parse_memory(self.model_memory_budget, "model_memory_budget")  # a bad size fails here

    @property
    def model_memory_budget_bytes(self) -> int | None:
        return parse_memory(self.model_memory_budget, "model_memory_budget")

    def with_env_api_keys(self, environ: Mapping[str, str] | None = None) -> ServerConfig:
        """This config with ``$INFERFLOW_API_KEYS`` added to ``api_keys`` and
        ``$INFERFLOW_ADMIN_KEYS`` to ``admin_keys`` (comma-separated), each key once: what the
        frontend runs with."""
        env = os.environ if environ is None else environ
        return dataclasses.replace(
            self,
            api_keys=_with_env_keys(self.api_keys, env.get(API_KEYS_ENV, "")),
            admin_keys=_with_env_keys(self.admin_keys, env.get(ADMIN_KEYS_ENV, "")),
        )


def _with_env_keys(configured: list[str], env: str) -> list[str]:
    keys = [str(k) for k in configured] + [k.strip() for k in env.split(",") if k.strip()]
    return list(dict.fromkeys(keys))


@dataclass
class RayAutoscalingConfig:
    """Engine replicas scaled on queue depth: the engines' waiting + running requests plus the
    requests queued in front of them, divided by ``target_per_replica`` (null = one replica's
    batch capacity, ``batching.max_num_seqs``)."""

    enabled: bool = False
    min_replicas: int = 1
    max_replicas: int = 2
    target_per_replica: int | None = None
    upscale_delay_s: float = 2.0
    downscale_delay_s: float = 10.0
    metrics_interval_s: float = 0.5  # how often each replica reports its queue depth
    look_back_period_s: float = 2.0  # the reports averaged over this window

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"autoscaling: need 1 <= min_replicas <= max_replicas, got "
                f"{self.min_replicas} and {self.max_replicas}"
            )
        if self.target_per_replica is not None and self.target_per_replica < 1:
            raise ValueError(f"autoscaling.target_per_replica: must be >= 1, got "
                             f"{self.target_per_replica}")


@dataclass
class RayServerConfig(ServerConfig):
    """``server=ray``: the composed graph on Ray Serve (``inferflow.server.ray``).

    ``host``/``port`` are Ray Serve's HTTP proxy; ``num_api_servers`` is the number of ingress
    replicas; the engine deployment has ``num_replicas`` replicas (or ``autoscaling``), each one
    engine with ``num_cpus``/``num_gpus`` reserved. ``address`` joins an existing cluster
    (``ray.init(address=...)``, e.g. ``auto``); null starts a local one that is shut down with
    the server.
    """

    runtime: ServerRuntime = ServerRuntime.ray
    address: str | None = None
    num_replicas: int = 1
    max_ongoing_requests: int | None = None  # per engine replica; null = batching.max_num_seqs
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    routing: RayRouting = RayRouting.prefix_aware
    # prefix-aware routing falls back to the less loaded replica when the holder of the prefix
    # has this many more requests in flight than the least loaded one
    prefix_imbalance_threshold: int = 8
    app_name: str = "inferflow"
    # an engine replica sends each ingress replica at most one message (the updates of all its
    # requests, merged) per this interval; the first after a pause, and one that ends a
    # request, go at once. As Ray Serve LLM's stream_batching_interval_ms (same default);
    # 0 = one message per engine flush
    stream_batching_interval_ms: float = 50.0
    # where Ray Serve runs its HTTP proxies (when this server starts Serve on the cluster)
    proxy_location: RayProxyLocation = RayProxyLocation.EveryNode
    # what stands on server.port before the ingress replicas (a Ray instance this server
    # starts; a joined cluster runs as its nodes were started): see server/ray/serve_env.py
    http_proxy: RayHttpProxy = RayHttpProxy.auto
    # an on-demand model of the repository (models: ... load: on_demand) runs no replica until
    # a request waits for it, and scales back to none after this long without requests
    model_idle_timeout_s: float = 300.0
    autoscaling: RayAutoscalingConfig = field(default_factory=RayAutoscalingConfig)

    def describe_host(self) -> str:
        a = self.autoscaling
        replicas = (f"{a.min_replicas}-{a.max_replicas} engine replicas (queue-depth autoscaling)"
                    if a.enabled else f"{self.num_replicas} engine replica(s)")
        where = f"cluster {self.address}" if self.address else "a local Ray instance"
        return f" on Ray Serve: {replicas}, {self.routing} routing, {where}"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas: must be >= 1, got {self.num_replicas}")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests: must be >= 1, got {self.max_ongoing_requests}")
