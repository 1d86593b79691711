"""benchmarks/run_suite.py: config matrix, server lifecycle, result files and summary."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from inferflow.testing.fake_server import FakeServer

pytestmark = pytest.mark.server

REPO = Path(__file__).resolve().parents[2]
FAST = ["--num-prompts", "3", "--input-len", "4", "--output-len", "3", "--num-warmups", "0"]
FAKE_CMD = "{python} -m inferflow.testing.fake_server --port {port} --ttft-ms 5 --token-delay-ms 1"


@pytest.fixture(scope="module")
def suite() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_suite", REPO / "benchmarks" / "run_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["run_suite"] = module
    spec.loader.exec_module(module)
    return module


def test_named_configs_vary_one_axis_from_the_base(suite: ModuleType) -> None:
    configs = {c.name: c.overrides for c in suite.named_configs(None)}
    assert configs["batching-none"] == (
        "batching=none",
        "cache=prefix",
        "tracing=off",
        "executor.precision=fp32",
    )
    assert "cache=none" in configs["prefix-cache-off"]
    assert "executor.precision=int4" in configs["precision-int4"]
    with pytest.raises(SystemExit):
        suite.named_configs(["no-such-config"])


def test_sweep_is_a_cartesian_product(suite: ModuleType) -> None:
    configs = suite.sweep_configs(["batching=none,continuous", "cache=prefix,none"])
    assert [c.name for c in configs] == [
        "batching=none,cache=prefix",
        "batching=none,cache=none",
        "batching=continuous,cache=prefix",
        "batching=continuous,cache=none",
    ]
    assert "cache=none" in configs[1].overrides and "tracing=off" in configs[1].overrides


def test_server_command_template(suite: ModuleType) -> None:
    cmd = suite.server_command(suite.DEFAULT_SERVER_CMD, 8123, ("batching=none", "cache=none"))
    assert cmd == [
        sys.executable,
        "-m",
        "inferflow",
        "server.port=8123",
        "batching=none",
        "cache=none",
    ]


def test_url_mode_measures_a_peer_and_writes_summary(
    suite: ModuleType, fake_server: Callable[..., FakeServer], tmp_path: Path
) -> None:
    server = fake_server(ttft_s=0.005, token_delay_s=0.001)
    code = suite.main(
        [
            "--url",
            server.url,
            "--label",
            "peer-x",
            "--concurrency",
            "1,2",
            "--results-dir",
            str(tmp_path),
            *FAST,
        ]
    )
    assert code == 0
    for c in (1, 2):
        result = json.loads((tmp_path / f"peer-x-c{c}.json").read_text())
        assert (result["label"], result["max_concurrency"], result["completed"]) == ("peer-x", c, 3)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.count("| peer-x |") == 2 and "Failures" not in summary


@pytest.mark.slow  # server subprocesses, started and stopped by the suite
def test_managed_servers_start_run_stop_and_failures_are_reported(
    suite: ModuleType, tmp_path: Path
) -> None:
    ok = suite.main(
        [
            "--configs",
            "batching-none,batching-continuous",
            "--concurrency",
            "2",
            "--server-cmd",
            FAKE_CMD,
            "--startup-timeout",
            "60",
            "--results-dir",
            str(tmp_path),
            *FAST,
        ]
    )
    assert ok == 0
    result = json.loads((tmp_path / "batching-none-c2.json").read_text())
    assert result["suite_config"] == "batching-none" and "batching=none" in result["overrides"]
    assert (tmp_path / "batching-continuous-c2.json").exists()
    assert (tmp_path / "logs" / "batching-none.log").exists()
    bad = suite.main(
        [
            "--configs",
            "tracing-otlp",
            "--concurrency",
            "1",
            "--server-cmd",
            "{python} -c 'import sys; print(\"no otlp\"); sys.exit(3)'",
            "--results-dir",
            str(tmp_path),
            *FAST,
        ]
    )
    assert bad == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "### tracing-otlp" in summary and "exited with code 3" in summary
    assert "no otlp" in summary  # the log tail explains why
    assert "| batching-none |" in summary  # earlier files are still tabulated
