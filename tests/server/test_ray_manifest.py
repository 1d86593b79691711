"""deploy/rayservice.yaml, validated offline: the Kubernetes objects against the Kubernetes
schemas (``kubernetes-validate``, strict), the RayService's pod templates as core/v1
PodTemplates, and its Serve config against what inferflow composes."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is a dev dependency")

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "rayservice.yaml"


def _documents() -> list[dict]:
    return [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]


def _rayservice() -> dict:
    (service,) = [d for d in _documents() if d["kind"] == "RayService"]
    return service


def test_core_objects_validate_against_the_kubernetes_schemas() -> None:
    core = [d for d in _documents() if d["apiVersion"] != "ray.io/v1"]
    assert core
    for doc in core:
        kv.validate(doc, kv.latest_version(), strict=True)


def test_the_pod_templates_are_valid_pod_templates() -> None:
    cluster = _rayservice()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        assert isinstance(group["rayStartParams"], dict)
        template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": group.get("groupName", "head")},
            "template": group["template"],
        }
        kv.validate(template, kv.latest_version(), strict=True)
    for worker in cluster["workerGroupSpecs"]:
        assert worker["minReplicas"] <= worker["replicas"] <= worker["maxReplicas"]


def test_the_serve_config_builds_inferflow_apps_from_valid_overrides() -> None:
    from inferflow.cli import compose_config
    from inferflow.config import typed_config
    from inferflow.config.server import RayServerConfig
    from inferflow.graph.repository import repository_entries

    serve_config = yaml.safe_load(_rayservice()["spec"]["serveConfigV2"])
    assert serve_config["http_options"]["port"] == 8000
    for app in serve_config["applications"]:
        module, attr = app["import_path"].split(":")
        assert callable(getattr(importlib.import_module(module), attr))
        cfg = compose_config(["server=ray", *app["args"]["overrides"]])  # unknown keys raise
        server = typed_config(RayServerConfig, cfg.server, "server")
        assert server.num_replicas >= 1 and str(server.runtime) == "ray"
        # several LLMs, one of them on demand: one engine deployment each
        entries = repository_entries(cfg)
        assert len(entries) == 3
        assert [e.key for e in entries if e.load.value == "on_demand"] == ["code"]
        assert sorted(e.model.model_id for e in entries) == ["chat@1", "chat@2", "code@1"]
