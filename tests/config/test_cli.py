"""The command line as users run it: ``python -m inferflow ...`` in a subprocess."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from cfg_helpers import run_cli

pytestmark = pytest.mark.server


def cfg_job(args: list[str], env: dict[str, str], cwd: Path) -> dict:
    proc = run_cli(["--cfg", "job", *args], env, cwd)
    assert proc.returncode == 0, proc.stderr
    return yaml.safe_load(proc.stdout)


def test_default_config_is_the_embedded_tiny_model(cli_env: dict[str, str], workdir: Path) -> None:
    cfg = cfg_job([], cli_env, workdir)
    assert cfg["model"]["builtin"] == "tiny_llama" and cfg["model"]["name"] == "tiny-llama"
    assert cfg["pipeline"] == [
        "validator",
        "tokenizer",
        "cache",
        "batching",
        "speculative",
        "guided",
        "lora",
        "executor",
        "detokenizer",
        "reasoning_parser",
        "tool_parser",
    ]
    assert cfg["tool_parser"]["_target_"] == "inferflow.stages.tool_parser.AutoToolParser"
    assert cfg["speculative"]["_target_"] == "inferflow.stages.speculative.NoSpeculation"
    assert cfg["guided"]["_target_"] == "inferflow.stages.guided.LLGuidanceDecoding"
    assert cfg["batching"]["_target_"] == "inferflow.stages.batching.ContinuousBatching"
    assert cfg["executor"]["precision"] == "fp32"
    assert cfg["tracing"]["exporter"] == "file"
    assert (cfg["server"]["host"], cfg["server"]["port"]) == ("127.0.0.1", 8000)
    assert cfg["task"] == "serve" and cfg["stages"] == {}


def test_readme_command_both_model_spellings(cli_env: dict[str, str], workdir: Path) -> None:
    plus = cfg_job(["+model=llama_8b", "batching=continuous"], cli_env, workdir)
    plain = cfg_job(["model=llama_8b", "batching=continuous"], cli_env, workdir)
    assert plus == plain
    assert plus["model"]["name"] == "llama-3.1-8b-instruct"
    assert plus["model"]["hf_repo"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert plus["model"]["builtin"] is None  # nothing of the default preset leaks in
    assert plus["batching"]["_target_"].endswith("ContinuousBatching")


def test_old_key_spelling_warns_once_on_the_command_line(
    cli_env: dict[str, str], workdir: Path
) -> None:
    proc = run_cli(["batching.max_batch_size=5", "task=check"], cli_env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert "batching.max_batch_size is deprecated: use batching.max_num_seqs" in proc.stderr
    assert "max_num_seqs=5" in proc.stdout and "max_batch_size" not in proc.stdout


def test_readme_batch_size_and_local_model(cli_env: dict[str, str], workdir: Path) -> None:
    cfg = cfg_job(
        [
            "batching.max_batch_size=64",
            "+model=local",
            "model.path=/models/x",
            "executor.precision=int4",
        ],
        cli_env,
        workdir,
    )
    # the README's old spelling lands under the name in effect (with a FutureWarning)
    assert cfg["batching"]["max_num_seqs"] == 64 and cfg["batching"]["max_batch_size"] is None
    assert cfg["model"]["path"] == "/models/x" and cfg["model"]["builtin"] is None
    assert cfg["executor"]["precision"] == "int4"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            "batching.max_num_seqs=abc",
            "batching.max_num_seqs: invalid value 'abc'; expected an integer",
        ),
        (
            "executor.precision=fp8",
            "executor.precision: invalid value 'fp8'; allowed values: fp32, fp16, bf16, int8, int4",
        ),
        (
            "batching.foo=1",
            "batching.foo: unknown key; allowed keys: _target_, max_num_seqs, max_num_batched_tokens",
        ),
        (
            "batching=foo",
            "batching=foo: unknown option; available: continuous, dynamic, none, static",
        ),
    ],
)
def test_bad_override_is_one_line_and_exit_2(
    override: str, expected: str, cli_env: dict[str, str], workdir: Path
) -> None:
    proc = run_cli([override], cli_env, workdir)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"inferflow: {expected}")
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["task=bench", "experiment.servers=0"], "experiment.servers: must be >= 1, got 0"),
        (["task=offline", "experiment.repeats=0"], "experiment.repeats: must be >= 1, got 0"),
        (["task=check", "experiment.warmup=-1"], "experiment.warmup: must be >= 0, got -1"),
    ],
)
def test_measuring_settings_out_of_range_are_one_line(
    args: list[str], expected: str, cli_env: dict[str, str], workdir: Path
) -> None:
    proc = run_cli(args, cli_env, workdir)
    assert proc.returncode == 2 and proc.stderr == f"inferflow: {expected}\n"


def test_a_group_given_twice_is_one_line_without_hydras_defaults_list_hint(
    cli_env: dict[str, str], workdir: Path
) -> None:
    proc = run_cli(["+extra_models=minilm", "+extra_models=minilm_canary"], cli_env, workdir)
    assert proc.returncode == 2 and "override extra_models" not in proc.stderr
    assert proc.stderr == (
        "inferflow: extra_models: given more than once on the command line; it takes one option\n"
    )


def test_help_lists_groups_and_info_shows_search_path(
    cli_env: dict[str, str], workdir: Path
) -> None:
    help_ = run_cli(["--help"], cli_env, workdir)
    assert help_.returncode == 0
    assert "batching: continuous, dynamic, none, static" in help_.stdout
    assert "model: gemma3_1b, llama_1b, llama_8b, local, minilm, mixtral_8x7b, phi4_mini, qwen3_0_6b, qwen3_30b_a3b, tiny_llama" in help_.stdout
    assert "extra_models: minilm, minilm_canary" in help_.stdout
    assert "_schema" not in help_.stdout  # schemas are not selectable options
    info = run_cli(["--info", "searchpath"], cli_env, workdir)
    assert info.returncode == 0 and "pkg://inferflow.conf" in info.stdout


def test_check_task_builds_the_graph_without_litter(cli_env: dict[str, str], workdir: Path) -> None:
    proc = run_cli(["task=check", "~cache", "batching=static"], cli_env, workdir)
    assert proc.returncode == 0, proc.stderr
    assert (
        "request stages: validator (RequestValidator) -> tokenizer (CheckpointTokenizer)"
        in proc.stdout
    )
    assert "batching: StaticBatching" in proc.stdout and "cache:" not in proc.stdout
    assert "response stages: none\n" in proc.stdout
    details = proc.stdout.split("(_target_, settings):\n", 1)[1].splitlines()
    assert [line.split(":")[0].strip() for line in details[:8]] == [
        "validator", "tokenizer", "batching", "speculative", "guided", "lora", "executor",
        "detokenizer"
    ]  # the pipeline's order, the removed cache slot left out
    assert "  executor: OnnxRuntimeExecutor _target_=inferflow.stages.executor." in proc.stdout
    assert "_executor" not in proc.stdout  # internals are not settings
    assert list(workdir.iterdir()) == []  # no outputs/, .hydra/, log files in the cwd


def test_check_task_on_embedding_models(cli_env: dict[str, str], workdir: Path) -> None:
    alone = run_cli(["+model=minilm", "batching=dynamic", "task=check"], cli_env, workdir)
    assert alone.returncode == 0, alone.stderr
    assert "embedding model: all-minilm-l6-v2" in alone.stdout and "probe: 8 tokens" in alone.stdout
    both = run_cli(["+extra_models=minilm_canary", "task=check"], cli_env, workdir)
    assert both.returncode == 0, both.stderr
    assert "extra model: all-minilm-l6-v2@1" in both.stdout and "weight=0.2" in both.stdout


def test_missing_checkpoint_names_where_it_looked(
    cli_env: dict[str, str], workdir: Path, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    models = tmp_path / "models"
    env = {**cli_env, "INFERFLOW_MODELS_DIR": str(models)}
    proc = run_cli(["+model=llama_8b", "task=check"], env, workdir)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    line = proc.stderr
    assert str(models / "Llama-3.1-8B-Instruct") in line
    assert "INFERFLOW_MODELS_DIR" in line and "model.path=" in line
    # once the folder is there (any HF-layout checkpoint), the same command finds it
    models.mkdir()
    (models / "Llama-3.1-8B-Instruct").symlink_to(tiny_checkpoint)
    found = run_cli(["model=llama_8b", "task=check"], env, workdir)
    assert found.returncode == 0, found.stderr
    assert f"model: llama-3.1-8b-instruct ({models / 'Llama-3.1-8B-Instruct'})" in found.stdout


def test_local_model_without_path_is_a_clear_error(cli_env: dict[str, str], workdir: Path) -> None:
    proc = run_cli(["+model=local"], cli_env, workdir)
    assert proc.returncode == 2
    assert proc.stderr.startswith("inferflow: model.path: a checkpoint folder is required")


def test_disallowed_target_is_refused(cli_env: dict[str, str], workdir: Path) -> None:
    proc = run_cli(["task=check", "executor._target_=os.system"], cli_env, workdir)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("inferflow: executor._target_=os.system is not allowed")


def test_subcommands_dispatch(cli_env: dict[str, str], workdir: Path) -> None:
    proc = run_cli(["traces", "--help"], cli_env, workdir)
    assert proc.returncode == 0 and "usage:" in proc.stdout.lower()
