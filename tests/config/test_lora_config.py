"""The ``lora`` slot from the command line to the graph (issue 43): off by default (the engine as
before), ``lora.adapters.NAME=PATH`` without ``+``, ``~lora``, one-line errors naming the key, an
adapter named like a served model or an executor without LoRA refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from cfg_helpers import run_cli

from inferflow.cli import compose_config
from inferflow.compose import prepare_overrides
from inferflow.config import ConfigError
from inferflow.graph import build_graph
from inferflow.lora import LORA_TARGETS, LoraSpec
from inferflow.stages.lora import LoraStage


def graph_for(*overrides: str):
    return build_graph(compose_config(["model.max_model_len=256", *overrides]))


@pytest.mark.usefixtures("config_env")
def test_default_slot_is_off() -> None:
    graph = graph_for()
    assert graph.lora == LoraStage() and not graph.lora.enabled and graph.lora.spec() is None
    assert graph.config.lora._target_ == "inferflow.stages.lora.LoraStage"
    assert "lora" in graph.engine_slots
    graph.check_engine_settings()  # (nothing to check with LoRA off)


@pytest.mark.usefixtures("config_env")
def test_adapters_from_the_command_line_without_plus() -> None:
    graph = graph_for("lora.adapters.sql=/adapters/sql", "+lora.adapters.chat=/adapters/chat",
                      "lora.max_loras=2", "lora.max_lora_rank=8",
                      "lora.target_modules=[v_proj,q_proj]")
    assert graph.lora.adapters == {"sql": "/adapters/sql", "chat": "/adapters/chat"}
    assert graph.lora.spec() == LoraSpec(2, 8, ("q_proj", "v_proj"))  # LORA_TARGETS order
    assert graph.lora.cpu_loras == 2
    again = graph_for("lora.adapters.sql=/a", "lora.adapters.sql=/b")  # the last one wins
    assert again.lora.adapters == {"sql": "/b"}
    runtime = graph_for("lora.allow_runtime_updates=true", "lora.max_cpu_loras=9")
    assert runtime.lora.spec() == LoraSpec(4, 16, LORA_TARGETS) and runtime.lora.cpu_loras == 9


def test_the_adapters_override_is_rewritten_for_hydras_struct_mode() -> None:
    out = prepare_overrides(["lora.adapters.a=/x", "+lora.adapters.b=/y", "++lora.adapters.c=/z",
                             "lora.max_loras=2", "~lora.adapters.d"], environ={})
    assert [o for o in out if not o.startswith("hydra.searchpath")] == [
        "++lora.adapters.a=/x", "++lora.adapters.b=/y", "++lora.adapters.c=/z",
        "lora.max_loras=2", "~lora.adapters.d"]


@pytest.mark.parametrize("name", ["", " a", "a@1", "a/b"])
def test_adapter_names_a_request_could_not_select_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match=r"^adapters\..*: an adapter name must be non-empty"):
        LoraStage(adapters={name: "/x"})


@pytest.mark.usefixtures("config_env")
def test_removed_slot() -> None:
    graph = graph_for("~lora")
    assert graph.config.get("lora") is None and "lora" not in graph.engine_slots
    assert graph.lora.spec() is None


@pytest.mark.usefixtures("config_env")
@pytest.mark.parametrize(("override", "message"), [
    ("lora.max_loras=0", "lora.max_loras: must be >= 1, got 0"),
    ("lora.max_lora_rank=0", "lora.max_lora_rank: must be >= 1, got 0"),
    ("lora.max_cpu_loras=1", "lora.max_cpu_loras: must be >= max_loras (4), got 1"),
    ("lora.target_modules=[q_proj,lm_head]", "lora.target_modules: lm_head cannot be served"),
    ("lora.target_modules=[]", "lora.target_modules: needs at least one projection"),
])
def test_bad_settings_are_one_line_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        graph_for(override)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


@pytest.mark.usefixtures("config_env")
def test_an_adapter_named_like_a_served_model_is_refused() -> None:
    graph = graph_for("lora.adapters.tiny-llama=/adapters/x")
    with pytest.raises(ConfigError) as info:
        graph.check_engine_settings()
    assert info.value.key == "lora.adapters.tiny-llama"
    assert str(info.value).startswith("lora.adapters.tiny-llama: the name of a served model")
    renamed = graph_for("lora.adapters.tiny-llama=/adapters/x", "model.name=base")
    assert renamed.served_model_names() == {"base"}
    renamed.check_engine_settings()


@pytest.mark.usefixtures("config_env")
def test_an_executor_without_lora_is_refused() -> None:
    graph = graph_for("lora.adapters.a=/adapters/a", "executor=tensorrt")
    with pytest.raises(ConfigError, match=r"^lora: executor=tensorrt does not serve LoRA adapters"):
        graph.check_engine_settings()
    with pytest.raises(ValueError, match=r"^lora: executor=tensorrt does not serve"):
        graph.executor.enable_lora(LoraSpec(1, 8))
    onnx = graph_for("lora.adapters.a=/adapters/a")
    onnx.executor.enable_lora(LoraSpec(1, 8))
    assert onnx.executor.lora_spec == LoraSpec(1, 8)
    assert onnx.executor._runner_lora() == {"lora": LoraSpec(1, 8)}
    assert graph_for().executor._runner_lora() == {}  # LoRA off: the runner as before


def test_collision_at_start_is_one_line_and_exit_2(cli_env: dict[str, str],
                                                   workdir: Path) -> None:
    proc = run_cli(["task=check", "lora.adapters.tiny-llama=/adapters/x"], cli_env, workdir)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("inferflow: lora.adapters.tiny-llama: the name of a served model")
    assert proc.stderr.count("\n") == 1


@pytest.mark.usefixtures("config_env")
def test_llm_keywords() -> None:
    from inferflow.llm import _keyword_error, _overrides

    assert _overrides("lora_adapters", {"a": Path("/x y"), "b": "/z"}) == [
        "lora.adapters.a='/x y'", "lora.adapters.b='/z'"]
    assert _overrides("max_loras", 2) == ["lora.max_loras=2"]
    assert _overrides("enable_lora", True) == ["lora.allow_runtime_updates=true"]
    with pytest.raises(ConfigError) as info:
        graph_for(*_overrides("max_loras", 0))
    assert str(_keyword_error(info.value)).startswith("max_loras: must be >= 1")


def test_adapters_are_read_at_start(cli_env: dict[str, str], workdir: Path,
                                    tmp_path: Path) -> None:
    proc = run_cli(["task=check", f"lora.adapters.sql={tmp_path / 'nowhere'}"], cli_env, workdir)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("inferflow: lora.adapters.sql: adapter 'sql': ")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.usefixtures("config_env")
def test_a_repository_entry_adapter_named_like_a_model_is_refused() -> None:
    graph = graph_for("+models=tiny_canary", "models.int8.lora.adapters.tiny-llama=/adapters/x")
    with pytest.raises(ConfigError) as info:
        graph.check_engine_settings()
    assert info.value.key == "models.int8.lora.adapters.tiny-llama"
    fine = graph_for("+models=tiny_canary", "models.int8.lora.adapters.sql=/adapters/x")
    fine.check_engine_settings()
