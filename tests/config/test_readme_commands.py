"""README's "Serve and call it" commands, run verbatim as a newcomer would: on the embedded
default, in an empty HOME, against a live server on README's own address."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cfg_helpers import ISOLATED_VARS, REPO
from child_env import pythonpath

pytestmark = [pytest.mark.server, pytest.mark.slow]

README = (REPO / "README.md").read_text()
NEEDS_A_CHECKPOINT = ("+model=llama_8b", "model.path=/models/")  # placeholders for your files


def _section_blocks(heading: str, lang: str) -> list[str]:
    section = README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


SERVE_LINES = [
    line.split("  #", 1)[0].strip()
    for line in _section_blocks("Serve and call it", "bash")[0].splitlines()
    if line.strip()
]


@pytest.fixture
def newcomer_env(tmp_path: Path) -> dict[str, str]:
    """An empty HOME and none of inferflow's variables: the defaults README describes."""
    env = {k: v for k, v in os.environ.items() if k not in ISOLATED_VARS}
    for key in [k for k in env if k.startswith("INFERFLOW_") or k.startswith("HF_")]:
        del env[key]
    home = tmp_path / "home"
    home.mkdir()
    env.update(HOME=str(home), PYTHONPATH=pythonpath(base=env), PYTHONDONTWRITEBYTECODE="1")
    return env


def _run(
    command: str, env: dict[str, str], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    argv = shlex.split(os.path.expanduser(command.replace("~", env["HOME"], 1)))
    if argv[0] == "python":
        argv[0] = sys.executable
    elif argv[0] == "inferflow":
        argv = [sys.executable, "-m", "inferflow", *argv[1:]]
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _python(
    code: str, env: dict[str, str], cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run a README Python block as a newcomer would paste it."""
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_configuration_command_builds_its_graph(
    newcomer_env: dict[str, str], tmp_path: Path
) -> None:
    """Each ``python -m inferflow ...`` line with ``task=check`` (what it would serve, checked
    without serving); the ones that name your own checkpoint fail in one line saying how to fix."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    commands = [c for c in SERVE_LINES if c.startswith("python -m inferflow")]
    assert len(commands) >= 8
    for command in commands:
        extra = "" if "--cfg" in command else " task=check"
        if " -m +experiment" in command:
            extra += f" hydra.sweep.dir={tmp_path / 'sweep'}"
        proc = _run(command + extra, newcomer_env, cwd)
        if any(marker in command for marker in NEEDS_A_CHECKPOINT):
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (command, proc.stderr)
            assert "model.path" in proc.stderr, (command, proc.stderr)
        else:
            assert proc.returncode == 0, (command, proc.stderr[-2000:])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.fixture
def readme_server(newcomer_env: dict[str, str], tmp_path: Path) -> Iterator[None]:
    """``python -m inferflow`` exactly as README starts it (127.0.0.1:8000)."""
    if not _port_free(8000):
        pytest.skip("port 8000 is taken: README's commands use it")
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferflow"],
        env=newcomer_env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                if httpx.get("http://127.0.0.1:8000/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "README's server did not become ready"
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.mark.usefixtures("readme_server")
def test_readme_client_bench_and_traces_commands_work_verbatim(
    newcomer_env: dict[str, str], tmp_path: Path
) -> None:
    client = _section_blocks("Serve and call it", "python")[0]
    proc = _python(client, newcomer_env)
    assert proc.returncode == 0, proc.stderr
    assert "completion_tokens" in proc.stdout  # the usage chunk came last
    structured = _section_blocks("Serve and call it", "python")[1]  # uses the client above
    proc = _python(client + "\n" + structured, newcomer_env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["mood"] in ("happy", "sad")
    bench = next(c for c in SERVE_LINES if c.startswith("inferflow bench"))
    ran = _run(bench, newcomer_env, tmp_path)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert re.search(r"Successful requests:\s+64", ran.stdout), ran.stdout
    traces = next(c for c in SERVE_LINES if c.startswith("inferflow traces"))
    deadline = time.monotonic() + 30  # spans reach the file in batches
    while True:
        shown = _run(traces, newcomer_env, tmp_path)
        if shown.returncode == 0 and "trace " in shown.stdout:
            break
        assert time.monotonic() < deadline, shown.stderr
        time.sleep(0.5)


def test_offline_api_and_checkpoint_helper_commands_work_verbatim(
    newcomer_env: dict[str, str], tmp_path: Path
) -> None:
    offline = _section_blocks("Offline API", "python")[0]
    proc = _python(offline, newcomer_env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    make, serve = _section_blocks("Offline API", "bash")[0].strip().splitlines()
    target = tmp_path / "llama-small"  # README writes /tmp/llama-small: same command, our folder
    assert (
        _run(make.replace("/tmp/llama-small", str(target)), newcomer_env, tmp_path).returncode == 0
    )
    checked = _run(
        serve.replace("/tmp/llama-small", str(target)) + " task=check", newcomer_env, tmp_path
    )
    assert checked.returncode == 0, checked.stderr[-2000:]
