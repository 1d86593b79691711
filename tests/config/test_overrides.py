"""What inferflow does to the command line before Hydra sees it (``inferflow.compose``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferflow import compose
from inferflow.compose import discover_plugins, merge_stage_overrides, prepare_overrides


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (["+stages=a", "x=1", "+stages=b"], ["+stages=[a,b]", "x=1"]),
        (["stages=a"], ["+stages=[a]"]),  # (Hydra alone: "Could not override 'stages'")
        (["+stages=[a,b]", "stages=c", "+stages=a"], ["+stages=[a,b,c]"]),
        (["+stages=a"], ["+stages=a"]),  # one: left as written
        (["+stages=a,b", "+stages=c"], ["+stages=a,b", "+stages=c"]),  # a sweep: Hydra's
        (["stages.a.limit=3", "+stages=a"], ["stages.a.limit=3", "+stages=a"]),  # a key
        (["stages=null", "+stages=a"], ["stages=null", "+stages=a"]),  # a value
    ],
)
def test_repeated_stage_overrides_become_one_list(given: list[str], expected: list[str]) -> None:
    assert merge_stage_overrides(given) == expected


def test_plugin_folders_are_passed_only_when_the_hydra_plugin_does_not_add_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERFLOW_CONFIG_PATH", str(tmp_path))
    mine = "hydra.searchpath=[file:///mine]"
    assert compose._searchpath_plugin_active()  # installed with inferflow (hydra_plugins/)
    assert prepare_overrides(["task=check", mine]) == [
        "task=check",
        "hydra.searchpath=['file:///mine']",
    ]
    assert prepare_overrides(["task=check"]) == ["task=check"]
    monkeypatch.setattr(compose, "_searchpath_plugin_active", lambda: False)
    added = [f"file://{tmp_path.resolve()}", *(p.search_path for p in discover_plugins())]
    quoted = ",".join(f"'{p}'" for p in ["file:///mine", *added])
    assert prepare_overrides(["task=check", mine]) == ["task=check", f"hydra.searchpath=[{quoted}]"]


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["-m", "batching=static,continuous", "task=check"], ["-m"]),
        (["--cfg", "job", "+model=local", "--resolve"], ["--cfg", "job", "--resolve"]),
        (["--info", "searchpath", "task=check"], ["--info", "searchpath"]),
        (["task=check", "--info"], ["--info"]),  # (--info's value is optional)
        (["-cn", "other", "--help", "~cache"], ["-cn", "other", "--help"]),
        (["--cfg=job", "x=1"], ["--cfg=job"]),
    ],
)
def test_hydra_flags_and_their_values_are_told_from_the_overrides(
    args: list[str], flags: list[str]
) -> None:
    """What Hydra's own argument parser would split (without importing hydra._internal)."""
    assert compose.split_args(args) == (flags, [a for a in args if a not in flags])


def test_a_sweep_run_folder_name_drops_the_measurement_settings_and_never_nests_or_overflows() -> None:
    """``hydra.sweep.subdir``'s name: the measurement's own keys (the same in every run) go,
    a path value does not make sub-folders, and a long list is cut with a hash that keeps runs
    apart (Linux refuses names over 255 characters)."""
    name = compose.run_dirname(
        ["+model=local", "model.path=/tmp/ckpt/llama", "task=bench", "batching.max_num_seqs=8",
         "experiment.workload.request_rate=2.5", "+experiment.goodput={ttft:3000,tpot:50}"]
    )  # fmt: skip
    assert name == "+model=local,model.path=_tmp_ckpt_llama,batching.max_num_seqs=8"
    long = [f"stages.s{i}.some_rather_long_option_name=value{i}" for i in range(12)]
    one, two = compose.run_dirname(long), compose.run_dirname([*long[:-1], "stages.s11.x=other"])
    assert len(one) == compose.RUN_DIRNAME_MAX and "/" not in one
    assert one != two and one[:100] == two[:100]
