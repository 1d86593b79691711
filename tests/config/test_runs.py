"""Experiments (-m sweeps) and the no-litter rule, through the real command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from cfg_helpers import run_cli

pytestmark = [pytest.mark.server, pytest.mark.slow]  # sweeps and runs through the CLI


def job_dirs(sweep: Path) -> list[Path]:
    return sorted(
        (p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("_")[0])
    )


def test_sweep_runs_each_job_in_its_own_folder_with_its_config(
    cli_env: dict[str, str], workdir: Path, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", "+experiment=batching_sweep", "task=check", f"hydra.sweep.dir={sweep}"]
    proc = run_cli(args, cli_env, workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr
    jobs = job_dirs(sweep)
    assert len(jobs) == 6  # batching: static,continuous x max_num_seqs: 1,4,16
    seen = set()
    for job in jobs:
        resolved = yaml.safe_load((job / "resolved_config.yaml").read_text())
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        kind = next(o.split("=")[1] for o in overrides if o.startswith("batching="))
        size = int(
            next(o.split("=")[1] for o in overrides if o.startswith("batching.max_num_seqs="))
        )
        assert resolved["batching"]["_target_"].endswith(f"{kind.capitalize()}Batching")
        assert resolved["batching"]["max_num_seqs"] == size
        assert resolved["model"]["path"] == str(tiny_checkpoint)  # resolved, reproducible
        assert (job / ".hydra" / "config.yaml").is_file()
        seen.add((kind, size))
    assert seen == {(k, s) for k in ("static", "continuous") for s in (1, 4, 16)}
    assert list(workdir.iterdir()) == []


def test_sweep_folders_of_long_command_lines_and_paths_stay_flat_and_apart(
    cli_env: dict[str, str], workdir: Path, tmp_path: Path, tiny_checkpoint: Path
) -> None:
    """A measuring sweep's command line with the workload spelled out and a checkpoint path
    (over 255 characters as Hydra's own ``override_dirname``) runs: one folder per run, right
    under the sweep folder, with the swept value in its name."""
    sweep = tmp_path / "sweep"
    args = ["-m", "task=check", f"model.path={tiny_checkpoint}", "batching.max_num_seqs=2,4",
            *(f"experiment.workload.{k}={v}" for k, v in
              (("request_rate", 2.5), ("num_prompts", 96), ("input_len", 256), ("output_len", 64),
               ("dataset", "random"), ("burstiness", 1.0), ("seed", 3))),
            "+experiment.goodput={ttft: 3000, tpot: 50}", "tracing=off",
            f"hydra.sweep.dir={sweep}"]  # fmt: skip
    assert len(",".join(args)) > 300
    proc = run_cli(args, cli_env, workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr
    jobs = job_dirs(sweep)
    assert [j.name.split("_", 1)[0] for j in jobs] == ["0", "1"]
    for job, seqs in zip(jobs, (2, 4), strict=True):
        assert f"batching.max_num_seqs={seqs}" in job.name and len(job.name) <= 122
        assert (job / ".hydra" / "overrides.yaml").is_file()  # not nested by the path's "/"


def test_sweep_measures_each_batching_policy_offline(
    cli_env: dict[str, str], workdir: Path, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "+experiment=batching_sweep",
        "batching=static,continuous",
        "batching.max_num_seqs=2",
        "offline.num_prompts=3",
        "offline.prompt_len=8",
        "offline.max_tokens=4",
        f"hydra.sweep.dir={sweep}",
    ]
    proc = run_cli(args, cli_env, workdir, timeout=600)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads((job / "results.json").read_text()) for job in job_dirs(sweep)]
    assert [r["batching"] for r in results] == ["StaticBatching", "ContinuousBatching"]
    assert all(r["num_requests"] == 3 and r["output_throughput_tok_s"] > 0 for r in results)
    # each result records the point it measured (the swept values)
    assert [r["overrides"][:2] for r in results] == [
        [f"batching={kind}", "batching.max_num_seqs=2"] for kind in ("static", "continuous")
    ]
    assert list(workdir.iterdir()) == []


def test_plain_runs_write_nothing_but_opt_in_works(cli_env: dict[str, str], workdir: Path) -> None:
    for args in (["--cfg", "job"], ["task=check"], ["--help"]):
        proc = run_cli(args, cli_env, workdir)
        assert proc.returncode == 0, proc.stderr
    assert list(workdir.iterdir()) == []
    # the user may ask for Hydra's run folder and log file explicitly
    proc = run_cli(
        [
            "task=check",
            "hydra.run.dir=runs/a",
            "hydra.output_subdir=.hydra",
            "hydra/job_logging=default",
        ],
        cli_env,
        workdir,
    )
    assert proc.returncode == 0, proc.stderr
    assert (workdir / "runs" / "a" / ".hydra" / "config.yaml").is_file()
    assert (workdir / "runs" / "a" / "inferflow.log").is_file()
