"""``server=ray``: deploy the composed graph on Ray Serve and run until SIGTERM/SIGINT.

::

    HTTP on server.host:server.port: HAProxy before each ingress replica's own HTTP server
    (Ray Serve's high-throughput mode, server.http_proxy: serve_env.py), or Serve's proxy actor
    └── ingress deployment (server.num_api_servers replicas): the OpenAI routes, request stages,
        routing by model / name@version / LoRA adapter
        └── DeploymentHandle calls (PrefixAffinityRouter); updates back in one message per
            engine flush per ingress replica (transport.py)
            └── one engine deployment per LLM of the repository (models:; else the one model):
                eager: server.num_replicas, or autoscaled on queue depth;
                on demand: 0 replicas until a request waits, back to 0 after
                server.model_idle_timeout_s without requests.
                One LLMEngine + scheduler + EngineLoop per replica
    replica board (a Ray actor): each engine replica's stats and metrics for the ingress

Without ``server.address`` a local Ray instance is started on 127.0.0.1 and shut down on exit;
with one the app joins that cluster and only the app (and its board) is removed on exit.

Shutdown (SIGTERM, SIGINT): ``teardown.py`` -- the app is deleted (Serve drains its replicas for
``server.shutdown_grace_s``), then Serve is shut down if this process started it, then Ray if
this process started it; each step is bounded, and nothing the server started outlives it.
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
from inferflow.server.ray.serve_env import apply_serve_env
from inferflow.server.ray.teardown import ray_core_pids, teardown

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 900.0
_NOT_APPLICABLE = ("timeout_header_s", "timeout_body_s", "timeout_keep_alive_s")


def require_ray() -> None:
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ModuleNotFoundError:
        raise SystemExit('server=ray needs Ray Serve: pip install "inferflow[ray]"') from None


def engine_options(
    cfg: RayServerConfig,
    max_num_seqs: int,
    block_size: int,
    name: str = "engine",
    on_demand: bool = False,
) -> dict[str, Any]:
    """``serve.deployment`` options of an engine deployment, from the typed ``server`` config.
    ``on_demand``: 0 replicas until a request waits (Serve's own policy scales it from zero),
    back to 0 after ``model_idle_timeout_s`` without requests."""
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    options: dict[str, Any] = {
        "name": name,
        "max_ongoing_requests": cfg.max_ongoing_requests or max_num_seqs,
        "ray_actor_options": {"num_cpus": cfg.num_cpus, "num_gpus": cfg.num_gpus},
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 30.0,
        "graceful_shutdown_timeout_s": cfg.shutdown_grace_s,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    a = cfg.autoscaling
    if on_demand:
        top = a.max_replicas if a.enabled else cfg.num_replicas
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=0,
            max_replicas=max(1, top),
            initial_replicas=0,
            target_ongoing_requests=a.target_per_replica or max_num_seqs,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
            downscale_to_zero_delay_s=cfg.model_idle_timeout_s,
            metrics_interval_s=a.metrics_interval_s,
            look_back_period_s=a.look_back_period_s,
        )
    elif a.enabled:
        target = a.target_per_replica or max_num_seqs
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=a.min_replicas,
            max_replicas=a.max_replicas,
            initial_replicas=a.min_replicas,
            target_ongoing_requests=target,
            upscale_delay_s=a.upscale_delay_s,
            downscale_delay_s=a.downscale_delay_s,
            metrics_interval_s=a.metrics_interval_s,
            look_back_period_s=a.look_back_period_s,
            # the policy reads target_ongoing_requests as its queue depth per replica
            policy=AutoscalingPolicy(
                policy_function="inferflow.server.ray.autoscaling:queue_depth_policy"
            ),
        )
    else:
        options["num_replicas"] = cfg.num_replicas
    # our router either way: it routes readiness probes and LoRA loads to one named replica;
    # power_of_two is it without the prefix affinity
    router: dict[str, Any] = {  # (pydantic fields: mypy reads their types wrongly)
        "request_router_class": "inferflow.server.ray.routing:PrefixAffinityRouter",
        "request_router_kwargs": {
            "imbalance_threshold": cfg.prefix_imbalance_threshold,
            "block_size": block_size,
            "prefix_affinity": cfg.routing is RayRouting.prefix_aware,
        },
        "request_routing_stats_period_s": 1.0,
    }
    options["request_router_config"] = RequestRouterConfig(**router)
    return options


def build_app(graph: Any) -> tuple[Any, RayServerConfig]:
    """The Serve application for ``graph``: the ingress bound to one engine deployment per LLM
    of the model repository (``models:``; without it, the one model)."""
    from ray import serve

    from inferflow.config import LoadMode
    from inferflow.graph import build_entry_graph
    from inferflow.graph.repository import llm_entries
    from inferflow.server.process.runtime import telemetry_settings
    from inferflow.server.ray.engine_replica import EngineReplica
    from inferflow.server.ray.ingress import IngressDeployment
    from inferflow.server.ray.transport import new_key

    cfg: RayServerConfig = graph.server
    config = graph.to_container()
    board = f"{cfg.app_name}-board"
    key = new_key()  # signs the engine -> ingress update messages
    eager = cfg.autoscaling.min_replicas if cfg.autoscaling.enabled else cfg.num_replicas
    entries = [(e, build_entry_graph(e) if e.key else graph) for e in llm_entries(graph.config)]
    if not entries:
        raise SystemExit(
            "inferflow: models: has no LLM entry (an embedding-only server runs "
            "with server=default)"
        )
    names = [g.model_name for _, g in entries]
    engines: dict[str, Any] = {}
    required: dict[str, int] = {}
    for entry, entry_graph in entries:
        entry_graph.check_engine_settings()
        entry_config = entry_graph.to_container()
        on_demand = entry.load is LoadMode.on_demand
        # versions of one name: each its own series (model_name="NAME@VERSION")
        name_count = names.count(entry_graph.model_name)
        label = f"{entry_graph.model_name}@{entry_graph.model.version}" if name_count > 1 else None
        telemetry = telemetry_settings(entry_graph, entry_config, label)
        name = f"engine-{entry.key}" if entry.key else "engine"
        engine = serve.deployment(
            **engine_options(
                cfg, entry_graph.batching.max_num_seqs, _block_size(entry_graph), name, on_demand
            )
        )(EngineReplica)
        # a replica whose engine thread has not gone round for worker_watchdog_s fails its
        # health check and is replaced (the LitServe host's watchdog)
        engines[entry.key] = engine.bind(
            entry_config,
            telemetry,
            str(cfg.log_level),
            board,
            cfg.worker_watchdog_s,
            cfg.stream_batching_interval_ms,
            entry.key,
            key,
        )
        required[entry.key] = 0 if on_demand else eager
    ingress = serve.deployment(
        name="ingress",
        num_replicas=cfg.num_api_servers,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=max(cfg.max_connections or 4096, 1),  # requests per ingress
        graceful_shutdown_timeout_s=cfg.shutdown_grace_s,
        graceful_shutdown_wait_loop_s=0.5,
    )(serve.ingress()(IngressDeployment))
    app = ingress.bind(
        engines,
        config,
        telemetry_settings(graph, config),
        board,
        required,
        key,
        cfg.num_api_servers,
    )
    return app, cfg


def serve_on_ray(graph: Any) -> None:
    """Deploy ``graph`` and block until a signal; then delete the app (draining its replicas)
    and, if this process started Ray, shut it down."""
    if graph.model.is_embedding:
        raise SystemExit(
            "inferflow: server=ray serves an LLM (with +extra_models embedding "
            "models beside it); an embedding-only server runs with server=default"
        )
    cfg: RayServerConfig = graph.server
    local = cfg.address is None
    # before ray is imported: Serve reads its settings from the environment at import
    proxy_mode = apply_serve_env(cfg, local)
    require_ray()
    import ray

    from inferflow.server.ray.board import NAMESPACE

    for key in _NOT_APPLICABLE:
        if getattr(cfg, key) != getattr(RayServerConfig(), key):
            logger.warning(
                "server.%s does not apply under server=ray (Ray Serve's proxy holds "
                "the connections)",
                key,
            )
    if local:
        ray.init(
            address="local",
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            namespace=NAMESPACE,
            num_cpus=max(os.cpu_count() or 1, _cpus_needed(cfg, _llm_count(graph))),
        )
    else:
        ray.init(address=cfg.address, namespace=NAMESPACE)
    core = ray_core_pids() if local else []
    node_id = ray.get_runtime_context().get_node_id() if local else ""
    logger.info("inferflow: the local Ray instance's GCS and raylet: %s", core)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which installs its own
        signal.signal(sig, lambda *_: stop.set())
    started_serve = not _serve_running()
    try:
        app, cfg = build_app(graph)
        if started_serve:
            _start_serve(cfg)
        else:  # Serve's proxies are already up: their address is not ours to choose
            logger.warning(
                "Ray Serve already runs on this cluster: the app joins its HTTP "
                "proxies; server.host, server.port and server.proxy_location are "
                "not applied"
            )
        _deploy(app, cfg.app_name)
        # our own proxy on this host: also wait for the ingress's /ready there
        _wait_ready(cfg, started_serve and (local or cfg.address in ("auto", "local")), stop)
        if not stop.is_set():
            print(
                f"{_start_line(graph)} | ray {ray.__version__} "
                f"({'local' if local else cfg.address}; {proxy_mode})",
                flush=True,
            )
        stop.wait()
        logger.info("inferflow: shutting down the Serve app %s", cfg.app_name)
    finally:
        teardown(cfg, local, started_serve, core, node_id)


def _start_serve(cfg: RayServerConfig) -> None:
    """``serve.start`` with our HTTP address. It waits for the proxies' first ready check; a
    proxy that misses it (a loaded machine) is killed and restarted by Serve's controller, but
    the call fails with that proxy's death: then it is called once more, which joins the
    controller it created (the proxy's readiness is waited for over HTTP, ``_wait_ready``)."""
    import ray
    from ray import serve

    options: dict[str, Any] = {"http_options": {"host": cfg.host, "port": cfg.port},
                               "proxy_location": str(cfg.proxy_location)}  # fmt: skip
    try:
        serve.start(**options)
    except ray.exceptions.ActorDiedError as exc:
        logger.warning("inferflow: a Serve proxy died during its start (%s); Serve restarts it",
                       str(exc).splitlines()[0])  # fmt: skip
        serve.start(**options)


def _deploy(app: Any, name: str) -> None:
    """Submit the app without waiting for it to run (``_wait_ready`` waits, and a signal can end
    that wait; ``serve.run`` would hold the main thread until every replica is up)."""
    try:
        from ray.serve.api import _run
    except ImportError:  # (a Ray without it: wait in serve.run)
        from ray import serve

        serve.run(app, name=name, route_prefix="/", blocking=False)
        return
    _run(app, name=name, route_prefix="/", _blocking=False)


def _start_line(graph: Any) -> str:
    """The ready line: the one model's, or the repository's list of LLMs."""
    from inferflow.graph.repository import llm_entries
    from inferflow.server.process.runtime import start_line

    settings = graph.server.with_env_api_keys()
    entries = llm_entries(graph.config)
    if not entries[0].key:
        return start_line(graph, settings)
    listed = ", ".join(
        f"{e.key}{' (on demand)' if e.load.value == 'on_demand' else ''}" for e in entries
    )
    return (
        f"inferflow: ready: {len(entries)} LLM(s) at http://{settings.host}:{settings.port}"
        f"/v1: {listed}"
    )


def _llm_count(graph: Any) -> int:
    from inferflow.graph.repository import llm_entries

    return len(llm_entries(graph.config))


def _block_size(graph: Any) -> int:
    """The prefix cache's block size (what the router hashes prompts by)."""
    return int(getattr(graph.cache, "block_size", 16) or 16)


def _cpus_needed(cfg: RayServerConfig, models: int = 1) -> int:
    """CPUs a local Ray instance needs for every model's replicas at their most."""
    replicas = cfg.autoscaling.max_replicas if cfg.autoscaling.enabled else cfg.num_replicas
    return int(models * replicas * cfg.num_cpus + 0.999)


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
