"""A checkpoint inferflow cannot serve is one line and exit code 2, at start and under
``task=check`` (never a traceback, never a worker that dies after the start), and the offline
``LLM(...)`` raises an exception whose message is that line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cfg_helpers import run_cli

from inferflow.models.tiny import make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.slow]  # one CLI run per broken checkpoint

SMALL = {"num_layers": 1, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2, "vocab_size": 512}


def _checkpoint(root: Path, name: str, architecture: str = "LlamaForCausalLM", **changes: object) -> Path:
    path = make_checkpoint(root / name, architecture=architecture, **SMALL)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _one_line_exit_2(args: list[str], env: dict[str, str], cwd: Path, *words: str) -> None:
    proc = run_cli(args, env, cwd)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("inferflow: "), proc.stderr
    assert all(w in lines[0] for w in words), lines[0]


@pytest.mark.parametrize("task", ["task=check", "server.port=18431"])  # check, and serve
def test_unsupported_architecture(tmp_path: Path, cli_env: dict[str, str], workdir: Path, task: str) -> None:
    path = _checkpoint(tmp_path, "deepseek", architectures=["DeepseekV3ForCausalLM"])
    _one_line_exit_2([task, "+model=local", f"model.path={path}"], cli_env, workdir,
                     "'DeepseekV3ForCausalLM' is not supported", "LlamaForCausalLM, MistralForCausalLM")


def test_unsupported_field(tmp_path: Path, cli_env: dict[str, str], workdir: Path) -> None:
    path = _checkpoint(tmp_path, "relu2", hidden_act="relu2")
    _one_line_exit_2(["task=check", "+model=local", f"model.path={path}"], cli_env, workdir,
                     "config.json", "hidden_act='relu2' is not supported")


def test_missing_file(tmp_path: Path, cli_env: dict[str, str], workdir: Path) -> None:
    path = _checkpoint(tmp_path, "no_tokenizer")
    (path / "tokenizer.json").unlink()
    _one_line_exit_2(["task=check", "+model=local", f"model.path={path}"], cli_env, workdir,
                     "tokenizer.json is missing")


def test_a_context_longer_than_the_sliding_window_is_served(
    tmp_path: Path, cli_env: dict[str, str], workdir: Path
) -> None:
    """The executors attend through the window (issue 39): no cap on the context any more."""
    path = _checkpoint(tmp_path, "mistral", "MistralForCausalLM", sliding_window=128)
    proc = run_cli(["task=check", "+model=local", f"model.path={path}", "model.max_model_len=512"],
                   cli_env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert "max_model_len=512" in proc.stdout


def test_offline_llm_raises_the_same_line(tmp_path: Path) -> None:
    from inferflow import LLM
    from inferflow.config.base import ConfigError

    path = _checkpoint(tmp_path, "relu2", hidden_act="relu2")
    with pytest.raises(ConfigError) as info:
        LLM(str(path), max_slots=1, max_model_len=256)
    assert "\n" not in str(info.value)
    assert "hidden_act='relu2' is not supported" in str(info.value)
    window = _checkpoint(tmp_path, "mistral", "MistralForCausalLM", sliding_window=64)
    llm = LLM(str(window), max_slots=1, max_model_len=256)  # past the window: served
    assert llm.engine.max_model_len == 256
