"""``server.http_proxy``: the environment the Ray host sets before Ray starts
(``inferflow.server.ray.serve_env``), and how its teardown finds the HAProxy Serve orphans. The servers that run in it are in test_ray_host.py (a
local instance: HAProxy before the ingress; the joined loopback cluster: Serve's stock proxy)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inferflow.config.server import RayHttpProxy, RayServerConfig
from inferflow.server.ray import serve_env
from inferflow.server.ray.serve_env import apply_serve_env, haproxy_binary
from inferflow.server.ray.teardown import _orphans


def _cfg(mode: str, address: str | None = None) -> RayServerConfig:
    return RayServerConfig(http_proxy=RayHttpProxy(mode), address=address)


@pytest.fixture
def fake_haproxy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    binary = tmp_path / "haproxy"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("RAY_SERVE_HAPROXY_BINARY_PATH", str(binary))
    return binary


def test_an_explicit_binary_path_is_what_serve_would_start(fake_haproxy: Path) -> None:
    assert haproxy_binary() == str(fake_haproxy)


def test_auto_with_haproxy_sets_the_high_throughput_mode_on_free_ports(fake_haproxy: Path) -> None:
    env = serve_env.serve_env(_cfg("auto"), local=True)
    assert env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    ports = [
        env[k]
        for k in (
            "RAY_SERVE_HAPROXY_STATS_PORT",
            "RAY_SERVE_HAPROXY_METRICS_PORT",
            "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT",
            "RAY_SERVE_FALLBACK_PROXY_GRPC_PORT",
        )
    ]
    # not HAProxy's fixed defaults (8404, 9101) nor the fallback proxy's (8500, 9500): two
    # servers on one machine must not collide
    assert len(set(ports)) == 4 and not {"8404", "9101", "8500", "9500"} & set(ports)
    assert env["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == serve_env.DRAIN_S


def test_auto_without_haproxy_keeps_serves_proxy_throughput_optimized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(serve_env, "haproxy_binary", lambda: None)
    assert serve_env.serve_env(_cfg("auto"), local=True) == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
        "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": serve_env.PROXY_READY_S,
    }


def test_haproxy_without_a_binary_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_env, "haproxy_binary", lambda: None)
    with pytest.raises(SystemExit, match=r"server\.http_proxy=haproxy: no HAProxy binary"):
        serve_env.serve_env(_cfg("haproxy"), local=True)


def test_serve_mode_and_a_joined_cluster_set_nothing(fake_haproxy: Path) -> None:
    assert serve_env.serve_env(_cfg("serve"), local=True) == {}
    # a joined cluster's Serve processes run with the environment its nodes were started with
    assert serve_env.serve_env(_cfg("auto", address="auto"), local=False) == {}


def test_a_variable_the_user_set_wins(fake_haproxy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (a copy of the environment: what apply_serve_env sets must not reach other tests)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    env |= {"RAY_SERVE_HAPROXY_BINARY_PATH": str(fake_haproxy), "RAY_SERVE_ENABLE_HA_PROXY": "0"}
    monkeypatch.setattr(os, "environ", env)
    described = apply_serve_env(_cfg("auto"), local=True)
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert described == "Serve's proxy, throughput-optimized Serve"


def test_haproxys_extra_ports_stay_out_of_the_ranges_ray_takes_ports_from(
    fake_haproxy: Path,
) -> None:
    env = serve_env.serve_env(_cfg("auto"), local=True)
    for key in ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT"):
        assert int(env[key]) in serve_env.PORT_RANGE


def test_a_process_naming_the_local_node_is_found_after_it_left_the_tree() -> None:
    """Serve's HAProxy outlives its manager actor as an orphan; the teardown finds it by the
    node id in its config path."""
    node_id = "ab" * 28
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(30)", f"/tmp/haproxy-serve/{node_id}/x"]
    )
    try:
        deadline = time.monotonic() + 10
        while proc.pid not in _orphans(node_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert proc.pid in _orphans(node_id)
        assert _orphans("") == []
    finally:
        proc.kill()
        proc.wait()


def test_a_mode_named_for_a_joined_cluster_is_warned_about(
    fake_haproxy: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING"):
        described = apply_serve_env(_cfg("serve", address="auto"), local=False)
    assert described == "the cluster's Serve proxy settings"
    assert "does not apply to a joined cluster" in caplog.text
