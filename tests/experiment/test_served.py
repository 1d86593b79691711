"""``task=bench``: served configs measured through the real command line (``python -m
inferflow -m ...``), a server subprocess per point; failed points; Ctrl+C stopping a sweep.

Timing values are never asserted: only that the figures exist, with their spread."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from child_env import pythonpath
from server_harness import alive, free_port

from inferflow.experiment.served import measure_served, serve_overrides
from inferflow.server.process_utils import descendants

ISOLATED_VARS = ("INFERFLOW_CONFIG_PATH", "INFERFLOW_MODELS_DIR", "INFERFLOW_TRACES_FILE")
TINY_WORKLOAD = [  # 8 prompts of 16 tokens, 8 out: seconds per point on two cores
    "experiment.workload.num_prompts=8",
    "experiment.workload.input_len=16",
    "experiment.workload.output_len=8",
    "experiment.workload.max_concurrency=4",
    "experiment.repeats=2",
    "experiment.warmup=1",
]
# a load that outlasts any test: the sweep is interrupted while it runs
ENDLESS_WORKLOAD = [
    "experiment.workload.num_prompts=100000",
    "experiment.workload.input_len=16",
    "experiment.workload.output_len=64",
    "experiment.workload.max_concurrency=2",
    "experiment.warmup=0",
]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The test run's environment (its INFERFLOW_HOME: the tiny model is generated once) with
    this checkout first on PYTHONPATH and no plugin variables."""
    base = {k: v for k, v in os.environ.items() if k not in ISOLATED_VARS}
    return {
        **base,
        "PYTHONPATH": pythonpath(base=base),
        "HF_HOME": str(tmp_path / "hf"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


@pytest.fixture
def cwd(tmp_path: Path) -> Path:
    path = tmp_path / "cwd"
    path.mkdir()
    return path


def inferflow(
    args: list[str], env: dict[str, str], cwd: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "inferflow", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def job_dirs(sweep: Path) -> list[Path]:
    return sorted(
        (p for p in sweep.iterdir() if p.is_dir()), key=lambda p: int(p.name.split("_")[0])
    )


@pytest.mark.server
@pytest.mark.slow
def test_served_sweep_measures_each_point_and_goes_on_past_a_refused_one(
    env: dict[str, str], cwd: Path, tmp_path: Path
) -> None:
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        "+experiment=served_sweep",  # task=bench, goodput SLOs (ttft, tpot)
        "batching.max_num_seqs=2,0,4",  # 0 is refused: recorded, the sweep goes on
        "batching.max_num_batched_tokens=2048",  # one value instead of the file's two
        "tracing=off",
        *TINY_WORKLOAD,
        f"hydra.sweep.dir={sweep}",
    ]
    proc = inferflow(args, env, cwd, timeout=600)
    assert proc.returncode == 2, proc.stderr  # a config problem in one point
    assert "batching.max_num_seqs" in proc.stderr and "Traceback" not in proc.stderr
    jobs = job_dirs(sweep)
    assert len(jobs) == 3
    results = [json.loads((job / "results.json").read_text()) for job in jobs]
    good, refused = [results[0], results[2]], results[1]
    assert "batching.max_num_seqs=0" in refused["overrides"]
    assert refused["task"] == "bench" and "must be >= 1" in refused["failed"]
    for job, result, size in zip((jobs[0], jobs[2]), good, (2, 4), strict=True):
        assert "failed" not in result
        assert f"batching.max_num_seqs={size}" in result["overrides"]
        assert result["task"] == "bench" and result["repeats"] == 2 and result["warmup"] == 1
        assert result["workload"]["num_prompts"] == 8 and result["slo"] == {
            "ttft": 2000.0,
            "tpot": 200.0,
        }
        for name in ("p99_ttft_ms", "p99_tpot_ms", "median_ttft_ms", "request_goodput"):
            assert result["figures"][name]["n"] == 2 and len(result["figures"][name]["values"]) == 2
            assert result[name] == result["figures"][name]["mean"]
        assert result["output_throughput"] > 0 and result["completed"] == 8
        # lengths counted in the served checkpoint's tokens (the tiny model's folder)
        assert (Path(result["tokenizer"]) / "tokenizer.json").is_file()
        assert result["failed_requests"] == 0
        assert set(result["spread"]) == {"ok", "max_spread", "wide", "note"}
        assert len(result["per_repeat"]) == 2
        assert result["machine"]["cores"] >= 1
        # what was served: this point's engine settings, as the server reports them
        assert result["engine"]["scheduler"]["max_num_seqs"] == size
        log = (job / "server.log").read_text()
        assert "ready:" in log and f"max_num_seqs {size}" in log
    # one table across the runs (the summary callback): a row per point, the refused one failed,
    # each measured one's figures with the spread the repeats give; the plot of the two points
    with (sweep / "summary.csv").open() as stream:
        table = list(csv.DictReader(stream))
    assert [r["batching.max_num_seqs"] for r in table] == ["2", "0", "4"]
    assert table[1]["status"] == "failed" and "must be >= 1" in table[1]["note"]
    for row, result in zip((table[0], table[2]), good, strict=True):
        assert row["status"] in {"ok", "noisy"} and row["repeats"] == "2"
        for name in ("request_goodput", "p99_ttft_ms", "p99_tpot_ms", "output_throughput"):
            figure = result["figures"][name]
            assert float(row[name]) == pytest.approx(figure["mean"])
            assert float(row[f"{name}_pi95"]) == pytest.approx(figure["pi95"])
    text = (sweep / "summary.md").read_text()
    assert "| run | batching.max_num_seqs |" in text and "failed" in text
    assert text in proc.stdout  # printed at the end of the sweep
    png = (sweep / "summary.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    assert list(cwd.iterdir()) == []  # the servers wrote nothing where they were started


@pytest.mark.server
@pytest.mark.slow
def test_measure_served_reports_failures_in_one_line(env: dict[str, str], tmp_path: Path) -> None:
    """A server that does not start and a load whose every request fails are results with
    ``failed`` (a tuner records the point as infeasible), not exceptions."""
    workload = {"num_prompts": 2, "input_len": 8, "output_len": 2, "max_concurrency": 2}
    extra = {"PYTHONPATH": env["PYTHONPATH"]}
    missing = tmp_path / "no-such-checkpoint"
    result = measure_served(
        [f"model.path={missing}", "tracing=off"],
        workload,
        {},
        2,
        1,
        0.1,
        tmp_path / "a",
        120,
        extra,
    )
    assert result["failed"].startswith("the server did not start: server exited with code")
    assert str(missing) in result["failed"] and "\n" not in result["failed"]
    assert result["repeats"] == 0 and result["workload"]["num_prompts"] == 2
    assert (tmp_path / "a" / "server.log").is_file()
    # the server wants an API key the load does not send: every request fails
    result = measure_served(
        ["tracing=off"], workload, {"ttft": 100}, 2, 1, 0.1, tmp_path / "b", 120,
        {**extra, "INFERFLOW_API_KEYS": "k-secret"},
    )  # fmt: skip
    assert result["failed"].startswith("every warm-up request failed: ")
    assert "\n" not in result["failed"] and result["slo"] == {"ttft": 100.0}


def test_the_load_counts_lengths_with_the_served_checkpoints_tokenizer(tmp_path: Path) -> None:
    """A checkpoint outside this machine's model folders (``model.path``): its folder is the
    tokenizer the bench gets; a repository or a folder without ``tokenizer.json``: the
    bench's own lookup (None); overrides that do not compose: None, no exception."""
    from inferflow.experiment.served import tokenizer_of
    from inferflow.experiment.served_load import Client, bench_argv
    from inferflow.models.tiny import make_checkpoint

    folder = make_checkpoint(tmp_path / "ckpt", seed=3)
    assert tokenizer_of(["+model=local", f"model.path={folder}", "task=bench"]) == str(folder)
    repository = [f"+models.a.model.path={folder}", f"+models.b.model.path={folder}"]
    assert tokenizer_of(repository) is None
    (folder / "tokenizer.json").unlink()
    assert tokenizer_of(["+model=local", f"model.path={folder}"]) is None
    assert tokenizer_of(["no_such_group=x"]) is None
    load = {"dataset": "random", "num_prompts": 1, "input_len": 4, "output_len": 2,
            "request_rate": 1.0, "burstiness": 1.0, "seed": 0}  # fmt: skip
    argv = bench_argv(Client("http://127.0.0.1:1", None, "/ckpt"), load, {}, "t")
    assert argv[argv.index("--tokenizer") + 1] == "/ckpt"
    assert "--tokenizer" not in bench_argv(Client("http://127.0.0.1:1"), load, {}, "t")


def test_a_workload_of_the_users_own_prompts_reaches_the_bench(tmp_path: Path) -> None:
    """``experiment.workload.dataset=jsonl`` with ``dataset_path`` (and the random dataset's
    ``range_ratio`` and ``prefix_len``) are passed to ``inferflow bench``; jsonl without a
    path is refused in one line before any server starts."""
    from inferflow.config import ConfigError
    from inferflow.experiment.served_load import (
        Client,
        bench_args,
        bench_argv,
        check_load,
        workload_dict,
    )

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello there"}\n{"prompt": "and again"}\n')
    load = workload_dict({"dataset": "jsonl", "dataset_path": str(prompts), "num_prompts": 2})
    check_load(load, {})
    args = bench_args(bench_argv(Client("http://127.0.0.1:1"), load, {}, "t"))
    assert (args.dataset_name, args.dataset_path, args.num_prompts) == ("jsonl", str(prompts), 2)
    shaped = workload_dict({"range_ratio": 0.5, "prefix_len": 16})
    args = bench_args(bench_argv(Client("http://127.0.0.1:1"), shaped, {}, "t"))
    assert (args.range_ratio, args.prefix_len) == (0.5, 16)
    with pytest.raises(ConfigError, match="jsonl dataset needs a path"):
        check_load(workload_dict({"dataset": "jsonl"}), {})


def test_serve_overrides_keep_the_config_and_drop_the_measuring() -> None:
    overrides = [
        "task=bench",
        "+experiment=served_sweep",
        "experiment.repeats=2",
        "+experiment.goodput.ttft=500",
        "batching.max_num_seqs=8",
        "server.port=1234",
        "server.host=0.0.0.0",
        "~cache",
    ]
    assert serve_overrides(overrides) == [
        "+experiment=served_sweep",
        "batching.max_num_seqs=8",
        "~cache",
    ]
    # where the config came from stays; Hydra's other settings do not
    sources = ["--config-dir=/my/conf", "hydra.searchpath=[file:///my/more]", "hydra.run.dir=x"]
    assert serve_overrides(sources) == sources[:2]


@pytest.fixture
def sweep_process(env: dict[str, str], cwd: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Sweeps started by a test; whatever is left of them is killed at the end."""
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        for pid in [proc.pid, *descendants(proc.pid)]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


def start_sweep(
    args: list[str], env: dict[str, str], cwd: Path, procs: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    return start_inferflow(["-m", *args], env, cwd, procs)


def start_inferflow(
    args: list[str], env: dict[str, str], cwd: Path, procs: list[subprocess.Popen[str]]
) -> subprocess.Popen[str]:
    """``python -m inferflow ARGS`` in the background (killed at the test's end, with what it
    started, by ``sweep_process``)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferflow", *args],
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    procs.append(proc)
    return proc


def wait_for(predicate, proc: subprocess.Popen[str], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the sweep ended before {what}: {proc.communicate()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def interrupt(proc: subprocess.Popen[str], sig: int = signal.SIGINT) -> tuple[int, str]:
    """Send ``sig`` to the sweep (as Ctrl+C does to its main process); its exit code and
    stderr, after every process it started is gone."""
    tree = [proc.pid, *descendants(proc.pid)]
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=120)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in tree if alive(p)], "processes of the sweep outlived it"
    return proc.returncode, stderr


@pytest.mark.server
@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_a_bench_sweep_and_its_server(
    sig: int, env: dict[str, str], cwd: Path, tmp_path: Path, sweep_process: list
) -> None:
    """Ctrl+C (or SIGTERM) while a point's load runs: its server (in a session of its own, so
    the terminal's Ctrl+C does not reach it) is stopped and no later point starts."""
    sweep = tmp_path / "sweep"
    args = [
        "task=bench",
        "batching.max_num_seqs=2,4",
        "tracing=off",
        *ENDLESS_WORKLOAD,
        f"hydra.sweep.dir={sweep}",
    ]
    proc = start_sweep(args, env, cwd, sweep_process)

    def loading() -> bool:  # the first point's server is up and the load runs
        logs = list(sweep.glob("0_*/server.log"))
        return bool(logs) and "ready:" in logs[0].read_text(errors="replace")

    wait_for(loading, proc, 180, "the first server")
    time.sleep(1.0)
    code, stderr = interrupt(proc, sig)
    assert code == 128 + sig, stderr
    name = signal.Signals(sig).name
    lines = [line for line in stderr.splitlines() if "interrupted" in line]
    assert lines == [
        f"inferflow: the sweep was interrupted ({name}): the running job stopped, "
        "no later job started"
    ]
    assert "Traceback" not in stderr
    assert [p.name.split("_")[0] for p in job_dirs(sweep)] == ["0"]  # no next job
    assert not (job_dirs(sweep)[0] / "results.json").exists()  # nothing half-measured


@pytest.mark.server
@pytest.mark.slow
def test_sigint_stops_a_sweep_of_servers(
    env: dict[str, str], cwd: Path, tmp_path: Path, sweep_process: list
) -> None:
    """``-m`` over a served config: Ctrl+C drains the running server and ends the sweep
    instead of starting the next point's server."""
    sweep, port = tmp_path / "sweep", free_port()
    args = ["batching.max_num_seqs=2,4", f"server.port={port}", "tracing=off"]
    proc = start_sweep([*args, f"hydra.sweep.dir={sweep}"], env, cwd, sweep_process)

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ready, proc, 180, "the first server")
    code, stderr = interrupt(proc)
    assert code == 130, stderr
    assert "inferflow: the sweep was interrupted (SIGINT)" in stderr
    assert "Traceback" not in stderr
    assert [p.name.split("_")[0] for p in job_dirs(sweep)] == ["0"]


def test_repeats_are_shared_evenly_among_servers() -> None:
    from inferflow.experiment.served import repeat_shares

    assert repeat_shares(3, 1) == [3]
    assert repeat_shares(3, 2) == [2, 1]
    assert repeat_shares(3, 3) == [1, 1, 1]
    assert repeat_shares(2, 5) == [1, 1]  # never a server without a repeat
    assert repeat_shares(0, 2) == [1]


@pytest.mark.server
@pytest.mark.slow
def test_repeats_spread_over_fresh_servers(env: dict[str, str], tmp_path: Path) -> None:
    """``servers=2``: two servers, one after another, each warmed up and logged; the result
    holds all the repeats (one spread over both) and says how many servers made them."""
    workload = {"num_prompts": 3, "input_len": 8, "output_len": 4, "max_concurrency": 3,
                "seed": 5}  # fmt: skip
    result = measure_served(
        ["tracing=off"], workload, {"ttft": 60000}, 3, 1, 0.5, tmp_path, 120,
        {"PYTHONPATH": env["PYTHONPATH"]}, servers=2,
    )  # fmt: skip
    assert "failed" not in result, result.get("failed")
    assert result["repeats"] == 3 and result["servers"] == 2
    assert len(result["figures"]["request_goodput"]["values"]) == 3
    assert result["machine"]["cpu_busy_pct"] is not None
    for name in ("server.log", "server-2.log"):
        assert "ready:" in (tmp_path / name).read_text()


@pytest.mark.server
@pytest.mark.slow
def test_sigterm_stops_inferflow_tune_and_the_server_it_measures(
    env: dict[str, str], cwd: Path, tmp_path: Path, sweep_process: list
) -> None:
    """``kill`` (or a CI job's timeout) on ``inferflow tune`` while it measures a point: the
    point's server (in a session of its own) is stopped with it, and what was tried is kept."""
    out = tmp_path / "tune"
    args = ["tune", "tracing=off", "experiment.warmup=0", "--slo", "ttft:2000", "--grid",
            "--space", "batching.max_num_seqs=2,4", "--num-prompts", "100000", "--input-len",
            "16", "--output-len", "64", "--max-concurrency", "2", "--name", "sigterm",
            "--out", str(out)]  # fmt: skip
    proc = start_inferflow(args, env, cwd, sweep_process)

    def loading() -> bool:  # the default's server is up and the endless load runs
        logs = list(out.glob("runs/*/server.log"))
        return bool(logs) and "ready:" in logs[0].read_text(errors="replace")

    wait_for(loading, proc, 180, "the first server")
    time.sleep(1.0)
    code, stderr = interrupt(proc, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, stderr
    assert f"inferflow tune: interrupted (SIGTERM); trials so far in {out}/trials.csv" in stderr
    assert "Traceback" not in stderr
    assert len(list(out.glob("runs/*"))) == 1  # no later point started


@pytest.mark.server
@pytest.mark.slow
def test_a_bench_of_a_config_from_the_users_config_dir_serves_that_config(
    env: dict[str, str], cwd: Path, tmp_path: Path
) -> None:
    """``--config-dir`` (and ``hydra.searchpath``) made the measuring run's config: the server
    it starts gets them too, and serves the user's option (it failed: unknown option)."""
    user = tmp_path / "my_conf"
    (user / "batching").mkdir(parents=True)
    (user / "batching" / "three.yaml").write_text(
        "defaults:\n  - /batching_continuous_schema@_here_\n  - _self_\nmax_num_seqs: 3\n"
    )
    out = tmp_path / "result.json"
    args = [f"--config-dir={user}", "task=bench", "batching=three", "tracing=off",
            *TINY_WORKLOAD, "experiment.repeats=1", f"offline.output={out}"]  # fmt: skip
    proc = inferflow(args, env, cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["engine"]["scheduler"]["max_num_seqs"] == 3 and result["completed"] == 8
