"""Plugins as users write them: a stage from a folder outside the package (INFERFLOW_CONFIG_PATH)
and a batching policy from a pip-installed package (entry point ``inferflow.plugins``)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from cfg_helpers import PII_CONF, PII_PLUGIN, run_cli
from child_env import pythonpath

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.graph import build_graph
from inferflow.models.tokenizer import Tokenizer
from inferflow.stages.base import ATTR_API_KEY_ID, ATTR_PRIORITY, ATTR_USER, StageRequest

pytestmark = pytest.mark.server

EMAIL_PROMPT = "Write to jane.doe@example.com or call 415-555-0132 about card 4111 1111 1111 1111."
REDACTED = "Write to [EMAIL] or call [PHONE] about card [CREDIT_CARD]."


@pytest.fixture
def pii_from_folder(config_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The PII plugin used without installing it: conf folder + module path + explicit trust."""
    monkeypatch.setenv("INFERFLOW_CONFIG_PATH", str(PII_CONF))
    monkeypatch.syspath_prepend(str(PII_PLUGIN))
    monkeypatch.setenv("INFERFLOW_ALLOWED_TARGETS", "inferflow_pii_redactor")


def test_pii_redactor_rules() -> None:
    sys.path.insert(0, str(PII_PLUGIN))
    try:
        from inferflow_pii_redactor import PIIRedactor
    finally:
        sys.path.remove(str(PII_PLUGIN))
    stage = PIIRedactor()
    stage.name = "pii"
    req = stage.process(
        StageRequest("r", prompt=EMAIL_PROMPT + " SSN 123-45-6789, host 10.0.0.255")
    )
    assert req.prompt == REDACTED + " SSN [SSN], host [IPV4]"
    assert req.attributes["pii.redactions"] == {
        "email": 1,
        "phone": 1,
        "credit_card": 1,
        "ssn": 1,
        "ipv4": 1,
    }
    # a 16-digit number failing the Luhn check is not a card (and not a phone number either)
    assert (
        stage.process(StageRequest("r", prompt="order 4111 1111 1111 1112")).prompt
        == "order 4111 1111 1111 1112"
    )
    chat = stage.process(
        StageRequest(
            "r",
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "me: a@b.io"}]},
                {"role": "assistant", "content": "ok"},
            ],
        )
    )
    assert (
        chat.messages[0]["content"][0]["text"] == "me: [EMAIL]"
        and chat.messages[1]["content"] == "ok"
    )
    only_email = PIIRedactor(entities=["email"], replacement="<{entity}>")
    assert only_email.process(StageRequest("r", prompt=EMAIL_PROMPT)).prompt.startswith(
        "Write to <EMAIL> or call 415"
    )
    with pytest.raises(ValueError, match="entities: unknown"):
        PIIRedactor(entities=["email", "dna"])


@pytest.mark.usefixtures("pii_from_folder")
def test_stage_from_a_folder_outside_the_package_runs_in_the_request_path(
    tiny_checkpoint: Path,
) -> None:
    graph = build_graph(compose_config(["+stages=pii_redactor"]))
    assert [s.name for s in graph.request_stages] == ["validator", "pii_redactor", "tokenizer"]
    out = graph.process(StageRequest("r", prompt=EMAIL_PROMPT))
    # the tokenizer saw the redacted text: the PII never reaches the engine
    assert out.prompt == REDACTED
    assert out.prompt_token_ids == Tokenizer(tiny_checkpoint).encode(REDACTED)
    assert out.attributes["pii_redactor.redactions"]["email"] == 1


@pytest.mark.usefixtures("pii_from_folder")
def test_plugin_stage_config_is_typed_at_build_time() -> None:
    with pytest.raises(ConfigError, match=r"^stages\.pii_redactor\.entities: unknown \['dna'\]"):
        build_graph(
            compose_config(["+stages=pii_redactor", "stages.pii_redactor.entities=[email,dna]"])
        )
    with pytest.raises(
        ConfigError, match=r"^stages\.pii_redactor\.bogus: unknown key; allowed keys: .*entities"
    ):
        build_graph(compose_config(["+stages=pii_redactor", "+stages.pii_redactor.bogus=1"]))


def test_folder_plugin_needs_explicit_trust(
    config_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERFLOW_CONFIG_PATH", str(PII_CONF))
    monkeypatch.syspath_prepend(str(PII_PLUGIN))
    with pytest.raises(ConfigError, match=r"inferflow_pii_redactor\.PIIRedactor is not allowed"):
        build_graph(compose_config(["+stages=pii_redactor"]))


def _pii_env(cli_env: dict[str, str]) -> dict[str, str]:
    """The CLI environment with the PII plugin used from its folder (not installed)."""
    return {
        **cli_env,
        "INFERFLOW_CONFIG_PATH": str(PII_CONF),
        "PYTHONPATH": pythonpath(PII_PLUGIN, base=cli_env),
        "INFERFLOW_ALLOWED_TARGETS": "inferflow_pii_redactor",
    }


@pytest.mark.slow  # several CLI runs
def test_folder_plugin_from_the_command_line(cli_env: dict[str, str], workdir: Path) -> None:
    env = _pii_env(cli_env)
    proc = run_cli(["task=check", "+stages=pii_redactor"], env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert "validator (RequestValidator) -> pii_redactor (PIIRedactor) -> tokenizer" in proc.stdout
    unknown = run_cli(["+stages=pii_redactr"], env, workdir)
    assert unknown.returncode == 2
    assert unknown.stderr.startswith("inferflow: stages=pii_redactr: unknown option; available: ")
    assert "pii_redactor" in unknown.stderr
    helped = run_cli(["--help"], env, workdir)  # the plugin's options are listed with the others
    assert helped.returncode == 0 and "stages: passthrough, pii_output_redactor, pii_redactor" in (
        helped.stdout
    )
    # a plugin bundled in plugins/ but not installed: the error says how to get it
    bare = run_cli(["task=check", "+stages=pii_redactor"], cli_env, workdir)
    assert bare.returncode == 2
    assert "pip install -e plugins/pii_redactor" in bare.stderr and bare.stderr.count("\n") == 1
    info = run_cli(["--info", "searchpath"], env, workdir)  # listed once, not once per adder
    assert info.returncode == 0 and info.stdout.count(PII_CONF.as_uri()) == 1, info.stdout


@pytest.mark.slow  # several CLI runs
def test_two_plugin_stages_repeated_or_as_one_list(cli_env: dict[str, str], workdir: Path) -> None:
    """``+stages=a +stages=b`` (the form a newcomer types) composes as ``'+stages=[a,b]'``."""
    env = _pii_env(cli_env)

    def stages(*args: str) -> dict:
        proc = run_cli(["--cfg", "job", *args], env, workdir)
        assert proc.returncode == 0, proc.stderr
        return yaml.safe_load(proc.stdout)["stages"]

    listed = stages("+stages=[pii_redactor,pii_output_redactor]")
    assert list(listed) == ["pii_redactor", "pii_output_redactor"]
    assert stages("+stages=pii_redactor", "+stages=pii_output_redactor") == listed
    mixed = stages("stages=passthrough", "+stages=pii_redactor", "+stages=[pii_output_redactor]")
    assert list(mixed) == ["passthrough", "pii_redactor", "pii_output_redactor"]
    proc = run_cli(["task=check", "+stages=pii_redactor", "+stages=pii_output_redactor"], env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert "validator (RequestValidator) -> pii_redactor (PIIRedactor) -> tokenizer" in proc.stdout
    assert "response stages: pii_output_redactor (PIIOutputRedactor)\n" in proc.stdout


@pytest.mark.slow  # pip-installs the plugin (once per session)
def test_installed_plugin_is_found_through_its_entry_point(
    installed_priority_plugin: Path, cli_env: dict[str, str], workdir: Path
) -> None:
    env = {**cli_env, "PYTHONPATH": pythonpath(installed_priority_plugin, base=cli_env)}
    proc = run_cli(["task=check", "batching=priority", "+batching.tiers.gold=0"], env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert "tokenizer (CheckpointTokenizer) -> priority_tagger (PriorityTagger)" in proc.stdout
    assert "batching: PriorityBatching" in proc.stdout and "tiers={'gold': 0}" in proc.stdout
    # the dry run names what runs: the tagger the policy adds, the policy's own order
    assert (
        "  priority_tagger: PriorityTagger _target_=inferflow_priority.policy.PriorityTagger"
        " (added by batching) tiers={'gold': 0}" in proc.stdout
    )
    assert "_target_=inferflow_priority.PriorityBatching" in proc.stdout
    assert "policy=PriorityBatching.sort_key" in proc.stdout and "max_batch_size" not in proc.stdout
    info = run_cli(["--info", "searchpath"], env, workdir)
    assert info.stdout.count("pkg://inferflow_priority.conf") == 1, info.stdout


@pytest.mark.slow  # pip-installs the plugin (once per session)
def test_installed_priority_policy_in_process(
    installed_priority_plugin: Path, config_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(installed_priority_plugin))
    graph = build_graph(
        compose_config(["batching=priority", "+batching.tiers.gold=0", "+batching.tiers.bulk=50"])
    )
    from inferflow.sampling_params import SamplingParams
    from inferflow.scheduling.request import Request

    def queued(rid: str, priority: int, arrival: float) -> Request:
        return Request(rid, [1], SamplingParams(), arrival_time=arrival, priority=priority)

    # the plugin's policy orders by priority, then arrival, whatever the queue order
    keys = {
        r.request_id: graph.batching.sort_key(r, seq)
        for seq, r in enumerate(
            [queued("late-gold", 0, 2.0), queued("bulk", 50, 0.0), queued("early-gold", 0, 1.0)]
        )
    }
    assert sorted(keys, key=keys.__getitem__) == ["early-gold", "late-gold", "bulk"]

    def priority(**attrs: object) -> int:
        return graph.process(StageRequest("r", prompt="hi", attributes=dict(attrs))).attributes[
            ATTR_PRIORITY
        ]

    assert priority(**{ATTR_API_KEY_ID: "gold", ATTR_USER: "bulk"}) == 0  # the key wins over user
    assert priority(**{ATTR_USER: "bulk"}) == 50
    assert (
        priority(**{ATTR_USER: "someone", ATTR_PRIORITY: -5}) == 10
    )  # clients cannot jump the queue
    graph = build_graph(
        compose_config(["batching=priority", "batching.allow_client_priority=true"])
    )
    assert (
        graph.process(StageRequest("r", prompt="hi", attributes={ATTR_PRIORITY: 30})).attributes[
            ATTR_PRIORITY
        ]
        == 30
    )
    with pytest.raises(
        ConfigError, match=r"^batching\.policy: batching=priority always uses 'priority'"
    ):
        build_graph(compose_config(["batching=priority", "+batching.policy=fcfs"]))


# ---------------------------------------------------------------------- live server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pii_server(
    cli_env: dict[str, str], workdir: Path, tiny_checkpoint: Path, tmp_path: Path
) -> Iterator[str]:
    """``python -m inferflow +model=local model.path=DIR +stages=pii_redactor``: a generated
    checkpoint served end to end with a plugin stage from a folder outside the package."""
    port = _free_port()
    env = {
        **cli_env,
        "INFERFLOW_CONFIG_PATH": str(PII_CONF),
        "PYTHONPATH": pythonpath(PII_PLUGIN, base=cli_env),
        "INFERFLOW_ALLOWED_TARGETS": "inferflow_pii_redactor",
    }
    args = [
        "+model=local",
        f"model.path={tiny_checkpoint}",
        "+stages=pii_redactor",
        f"server.port={port}",
        "tracing=off",
        "batching.max_num_seqs=2",
    ]
    log_path = tmp_path / "server.log"
    log = log_path.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferflow", *args], env=env, cwd=workdir, stdout=log, stderr=log
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)  # polling for readiness, not synchronising on a guess
        else:
            pytest.fail("server did not become ready in 120 s")
        proc_cwd = Path(f"/proc/{proc.pid}/cwd")
        if proc_cwd.exists():  # Linux: the server process did not chdir
            assert proc_cwd.resolve() == workdir.resolve()
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.mark.slow
def test_plugin_stage_in_a_live_request(
    pii_server: str, tiny_checkpoint: Path, workdir: Path
) -> None:
    models = httpx.get(f"{pii_server}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [tiny_checkpoint.name]  # local: the folder's name
    body = {
        "model": tiny_checkpoint.name,
        "prompt": EMAIL_PROMPT,
        "max_tokens": 2,
        "temperature": 0,
    }
    resp = httpx.post(f"{pii_server}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    tok = Tokenizer(tiny_checkpoint)
    redacted, original = len(tok.encode(REDACTED)), len(tok.encode(EMAIL_PROMPT))
    assert redacted != original
    assert json.loads(resp.text)["usage"]["prompt_tokens"] == redacted
    assert list(workdir.iterdir()) == []  # serving wrote nothing into the cwd
