"""``server=ray``: deploy the composed graph on Ray Serve and run until SIGTERM/SIGINT.

::

    Ray Serve HTTP proxy (server.host:server.port)
    └── ingress deployment (server.num_api_servers replicas): the OpenAI routes, request stages
        └── DeploymentHandle, streaming, PrefixAffinityRouter
            └── engine deployment (server.num_replicas, or autoscaled on queue depth):
                one LLMEngine + scheduler + EngineLoop per replica
    replica board (a Ray actor): each engine replica's stats and metrics for the ingress

Without ``server.address`` a local Ray instance is started on 127.0.0.1 and shut down on exit;
with one the app joins that cluster and only the app (and its board) is removed on exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
import urllib.request
from typing import Any

from inferflow.config.server import RayRouting, RayServerConfig

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
_NOT_APPLICABLE = ("timeout_header_s", "timeout_body_s", "timeout_keep_alive_s")


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit('server=ray needs Ray Serve: pip install "inferflow[ray]"') from None


def engine_options(cfg: RayServerConfig, max_num_seqs: int, block_size: int) -> dict[str, Any]:
    """``serve.deployment`` options of the engine deployment, from the typed ``server`` config."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    options: dict[str, Any] = {
        "name": "engine",
        "max_ongoing_requests": cfg.max_ongoing_requests or max_num_seqs,
        "ray_actor_options": {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": cfg.shutdown_grace_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    a = cfg.autoscaling
    if a.enabled:
        target = a.target_per_replica or max_num_seqs
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas, max_replicas=a.max_replicas,
            initial_replicas=a.min_replicas, target_ongoing_requests=target,
            upscale_delay_s=a.upscale_delay_s, downscale_delay_s=a.downscale_delay_s,
            metrics_interval_s=a.metrics_interval_s, look_back_period_s=a.look_back_period_s,
            # the policy reads target_ongoing_requests as its queue depth per replica
            policy=AutoscalingPolicy(
                policy_function="inferflow.server.ray.autoscaling:queue_depth_policy"))
    else:
        options["num_replicas"] = cfg.num_replicas
    if cfg.routing is RayRouting.prefix_aware:
        router: dict[str, Any] = {  # (pydantic fields: mypy reads their types wrongly)
            "request_router_class": "inferflow.server.ray.routing:PrefixAffinityRouter",
            "request_router_kwargs": {"imbalance_threshold": cfg.prefix_imbalance_threshold,
                                      "block_size": block_size},
            "request_routing_stats_period_s": 1.0,
        }
        options["request_router_config"] = RequestRouterConfig(**router)
    return options


def build_app(graph: Any) -> tuple[Any, RayServerConfig]:
    """The Serve application (ingress bound to the engine deployment) for ``graph``."""
    from ray import serve

    from inferflow.server.process.runtime import telemetry_settings
    from inferflow.server.ray.engine_replica import EngineReplica
    from inferflow.server.ray.ingress import IngressDeployment

    cfg: RayServerConfig = graph.server
    config = graph.to_container()
    telemetry = telemetry_settings(graph, config)
    board = f"{cfg.app_name}-board"
    engine = serve.deployment(
        **engine_options(cfg, graph.batching.max_num_seqs, _block_size(graph)))(EngineReplica)
    ingress = serve.deployment(
        name="ingress", num_replicas=cfg.num_api_servers, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(cfg.max_connections or 4096, 1),  # requests per ingress
        graceful_shutdown_timeout_s=cfg.shutdown_grace_s, graceful_shutdown_wait_loop_s=0.5,
    )(serve.ingress()(IngressDeployment))
    required = cfg.autoscaling.min_replicas if cfg.autoscaling.enabled else cfg.num_replicas
    # a replica whose engine thread has not gone round for worker_watchdog_s fails its health
    # check and is replaced (the LitServe host's watchdog; worker_stall_timeout_s is /ready's)
    watchdog = cfg.worker_watchdog_s
    app = ingress.bind(engine.bind(config, telemetry, str(cfg.log_level), board, watchdog,
                                   cfg.stream_batching_interval_ms),
                       config, telemetry, board, required)
    return app, cfg


def serve_on_ray(graph: Any) -> None:
    """Deploy ``graph`` and block until a signal; then delete the app (draining its replicas)
    and, if this process started Ray, shut it down."""
    if graph.model.is_embedding:
        raise SystemExit("inferflow: server=ray serves an LLM (with +extra_models embedding "
                         "models beside it); an embedding-only server runs with server=default")
    if graph.config.get("models"):
        raise SystemExit("inferflow: server=ray serves one LLM for now; the model repository "
                         "(models: ...) runs with server=default (docs/models.md)")
    require_ray()
    import ray
    from ray import serve

    from inferflow.server.process.runtime import start_line
    from inferflow.server.ray.board import NAMESPACE

    cfg: RayServerConfig = graph.server
    for key in _NOT_APPLICABLE:
        if getattr(cfg, key) != getattr(RayServerConfig(), key):
            logger.warning("server.%s does not apply under server=ray (Ray Serve's proxy holds "
                           "the connections)", key)
    local = cfg.address is None
    if local:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 namespace=NAMESPACE,
                 num_cpus=max(os.cpu_count() or 1, _cpus_needed(cfg)))
    else:
        ray.init(address=cfg.address, namespace=NAMESPACE)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    started_serve = not _serve_running()
    try:
        app, cfg = build_app(graph)
        if started_serve:
            serve.start(http_options={"host": cfg.host, "port": cfg.port},
                        proxy_location=str(cfg.proxy_location))
        else:  # Serve's proxies are already up: their address is not ours to choose
            logger.warning("Ray Serve already runs on this cluster: the app joins its HTTP "
                           "proxies; server.host, server.port and server.proxy_location are "
                           "not applied")
        serve.run(app, name=cfg.app_name, route_prefix="/", blocking=False)
        # our own proxy on this host: also wait for the ingress's /ready there
        _wait_ready(cfg, started_serve and (local or cfg.address in ("auto", "local")), stop)
        if not stop.is_set():
            print(start_line(graph, graph.server.with_env_api_keys()) + f" | ray {ray.__version__} "
                  f"({'local' if local else cfg.address})", flush=True)
        stop.wait()
        logger.info("inferflow: shutting down the Serve app %s", cfg.app_name)
    finally:
        _teardown(cfg, local, started_serve)


def _block_size(graph: Any) -> int:
    """The prefix cache's block size (what the router hashes prompts by)."""
    return int(getattr(graph.cache, "block_size", 16) or 16)


def _cpus_needed(cfg: RayServerConfig) -> int:
    replicas = cfg.autoscaling.max_replicas if cfg.autoscaling.enabled else cfg.num_replicas
    return int(replicas * cfg.num_cpus + 0.999)


def _local(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _wait_ready(cfg: RayServerConfig, local: bool, stop: threading.Event) -> None:
    """Until Serve reports the app RUNNING (every replica constructed: engines loaded and warm);
    a failed deployment stops the server with Serve's message. With a local proxy, also until
    the ingress's ``/ready`` (the replicas' reports read) says so."""
    from ray import serve

    deadline = time.time() + READY_TIMEOUT_S
    while not stop.is_set():
        app = serve.status().applications.get(cfg.app_name)
        state = str(getattr(app, "status", ""))
        if state.endswith("RUNNING"):
            break
        if app is not None and state.endswith("DEPLOY_FAILED"):
            raise SystemExit(f"inferflow: the Ray Serve app failed to deploy: {app.message}")
        if time.time() > deadline:
            raise SystemExit(f"inferflow: the Ray Serve app did not start in {READY_TIMEOUT_S} s")
        stop.wait(0.5)
    url = f"http://{_local(cfg.host)}:{cfg.port}/ready"
    while local and not stop.is_set() and time.time() < deadline:
        with contextlib.suppress(Exception), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:
                return
        stop.wait(0.25)


def _serve_running() -> bool:
    """Whether Ray Serve already runs on the cluster (its controller actor exists)."""
    import ray
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

    try:
        ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    except ValueError:
        return False
    return True


def _teardown(cfg: RayServerConfig, local: bool, started_serve: bool) -> None:
    """Delete the app; shut Serve down if this server started it, Ray if it started Ray."""
    import ray
    from ray import serve

    from inferflow.server.ray.board import NAMESPACE

    try:
        serve.delete(cfg.app_name)  # replicas drain (graceful_shutdown_timeout_s) and stop
    except Exception as exc:
        logger.warning("serve.delete: %s", exc)
    with contextlib.suppress(Exception):  # the board is gone already
        ray.kill(ray.get_actor(f"{cfg.app_name}-board", namespace=NAMESPACE))
    if started_serve:
        serve.shutdown()
    if local:
        ray.shutdown()

