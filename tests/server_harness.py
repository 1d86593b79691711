"""A real server subprocess, started as a user would: ``python -m inferflow server.port=N ...``.

``ServerProcess`` waits for ``/ready`` (bounded), talks to the server with ``httpx`` and the
``openai`` client on 127.0.0.1, and stops it with SIGTERM, killing whatever is left of its
process tree if it does not exit in time.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from child_env import child_env

from inferflow.bench.suite import kv_resident
from inferflow.server.process_utils import descendants

STARTUP_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0
MODEL = "tiny-llama"
# Keys of the limited server: one per test that consumes a per-key rate limit.
LIMITED_KEYS = [
    "k-main",
    "k-rpm",
    "k-tpm",
    "k-q1",
    "k-q2",
    "k-q3",
    "k-q4",
    "k-stream",
    "k-sse",
    "k-refund",
    "k-timeout",
]
LIMITED_ADMIN_KEY = "k-admin"  # an admin key only (from $INFERFLOW_ADMIN_KEYS)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def alive(pid: int) -> bool:
    """True unless the process is gone or a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class ServerProcess:
    """A ``python -m inferflow`` subprocess and helpers to talk to it."""

    def __init__(
        self, overrides: list[str], workdir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"server-{self.port}.log"
        cmd = [
            sys.executable,
            "-m",
            "inferflow",
            f"server.port={self.port}",
            *([] if any(o.startswith("tracing") for o in overrides) else ["tracing=off"]),
            *overrides,
        ]
        self.workdir = workdir
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir, env=child_env(env)
        )
        self.pid = self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def url(self, path: str) -> str:
        return self.base_url + path

    def get(self, path: str, **kwargs: object) -> httpx.Response:
        return httpx.get(self.url(path), timeout=30, **kwargs)  # type: ignore[arg-type]

    def post(self, path: str, **kwargs: object) -> httpx.Response:
        return httpx.post(self.url(path), timeout=60, **kwargs)  # type: ignore[arg-type]

    def stats(self, api_key: str | None = None) -> dict:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        response = self.get("/admin/stats", headers=headers)
        response.raise_for_status()
        return response.json()

    def client(self, api_key: str = "unused", **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.url("/v1"), api_key=api_key, max_retries=0, timeout=60, **kwargs
        )  # type: ignore[arg-type]

    def async_client(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.url("/v1"), api_key=api_key, max_retries=0, timeout=120
        )

    def tree(self) -> list[int]:
        return [self.pid, *descendants(self.pid)]

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                if self.get("/ready").status_code == 200 and self._kv_resident():
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log()[-4000:]}")

    def _kv_resident(self) -> bool:
        """Whether the worker finished making its KV memory resident (a background thread
        after start; tests with tight timeouts should not share the CPU with it)."""
        return kv_resident(self.base_url, getattr(self, "admin_key", None))

    def wait_until(self, predicate, timeout: float = 30.0, what: str = "condition") -> dict:
        """Poll ``/admin/stats`` until ``predicate(stats)`` holds (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats(api_key=getattr(self, "admin_key", None))
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; last stats: {stats}")
            time.sleep(0.05)

    def wait_until_refusing(self, timeout: float = 30.0) -> str:
        """After SIGTERM: wait until a new request is refused ("503" or "refused")."""
        deadline = time.monotonic() + timeout
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
        while time.monotonic() < deadline:
            try:
                response = httpx.post(self.url("/v1/completions"), json=body, timeout=10)
            except httpx.TransportError:
                return "refused"
            if response.status_code == 503:
                assert response.json()["error"]["code"] == "shutting_down"
                return "503"
            time.sleep(0.05)
        raise AssertionError("the server kept accepting requests after SIGTERM")

    def terminate(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM, wait; then SIGKILL every process of the tree that is left."""
        tree = self.tree()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -9
        for pid in tree:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(10)
        self._log.close()
        return code


def start_server(
    tmp_path_factory, name: str, overrides: list[str], env: dict[str, str] | None = None
) -> ServerProcess:
    """Start a server in a fresh folder and wait until it is ready."""
    server = ServerProcess(overrides, tmp_path_factory.mktemp(name), env)
    try:
        server.wait_ready()
    except BaseException:
        server.terminate(timeout=10)
        raise
    return server


def gone(pids: list[int], timeout: float) -> list[str]:
    """Wait until none of ``pids`` is alive; returns the command lines of the survivors.

    Children that observe the supervisor's exit (multiprocessing's resource tracker reads EOF,
    PR_SET_PDEATHSIG fires) finish a moment after it, hence the bounded wait.
    """
    deadline = time.monotonic() + timeout
    while (survivors := [p for p in pids if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [
        Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        for p in survivors
        if alive(p)
    ]


def trace_spans(path: Path) -> list[dict]:
    """Every span of a trace file (OTLP JSON, one export per line), in file order."""
    spans: list[dict] = []
    for line in path.read_text().splitlines() if path.exists() else []:
        for rs in json.loads(line).get("resourceSpans", ()):
            for ss in rs.get("scopeSpans", ()):
                spans += ss.get("spans", ())
    return spans
