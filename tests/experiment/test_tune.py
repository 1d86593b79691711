"""``inferflow tune``: the search space the schema declares, the engine model (the real scheduler
on a step-time model), the ``+tuned=NAME`` file, the search with a stand-in measurement, and
one small real run through the command line (slow)."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
import pytest
from child_env import pythonpath
from omegaconf import OmegaConf

from inferflow.compose import compose_config
from inferflow.config import ConfigError
from inferflow.config.tunable import Tunable, tunable, tunables
from inferflow.experiment import tune, tune_model, tune_trial
from inferflow.experiment.figures import Spread
from inferflow.experiment.simulate import CostModel, Profile, Workload, simulate
from inferflow.experiment.space import SearchSpace, parse_range
from inferflow.experiment.tune_winner import attains, measured_winner
from inferflow.graph import build_graph
from inferflow.stages.batching import ContinuousBatching
from inferflow.stages.registry import BUILTIN_OPTIONS, TUNABLE_OPTIONS


@pytest.fixture(scope="module")
def home() -> Path:
    """The suite's INFERFLOW_HOME, with the embedded tiny model generated there."""
    from inferflow.models.tiny import tiny_llama_path

    tiny_llama_path()
    return Path(os.environ["INFERFLOW_HOME"])


@pytest.fixture(scope="module")
def base(home: Path) -> Any:
    return compose_config([])


@pytest.fixture
def home_conf(home: Path) -> Iterator[Path]:
    """``$INFERFLOW_HOME/conf`` (where tune writes ``tuned/``), as it was after the test: once
    it exists it joins every later composition's search path."""
    conf = home / "conf"
    existed, tuned_existed = conf.exists(), (conf / "tuned").exists()
    yield conf
    if not existed:
        shutil.rmtree(conf, ignore_errors=True)
    elif not tuned_existed:
        shutil.rmtree(conf / "tuned", ignore_errors=True)


# ------------------------------------------------------------------ the declared space


def test_declared_knobs_exist_in_the_composed_config(base: Any) -> None:
    space = SearchSpace.declared(base)
    keys = {k.key for k in space.knobs}
    assert {
        "batching.max_num_seqs",
        "batching.max_num_batched_tokens",
        "cache",
        "speculative",
        "speculative.num_speculative_tokens",
        "executor.precision",
        "executor.intra_op_threads",
        "server.num_api_servers",
    } <= keys
    for knob in space.knobs:
        if knob.group:
            assert knob.key in TUNABLE_OPTIONS and set(knob.spec.choices) <= set(
                BUILTIN_OPTIONS[knob.key]
            )
            continue
        # a knob of one option exists once that option is selected
        cfg = base if knob.options is None else compose_config([f"{knob.slot}={knob.options[0]}"])
        assert OmegaConf.select(cfg, knob.key, default="<absent>") != "<absent>", knob.key


def test_tunable_metadata_is_on_the_stage_field() -> None:
    knobs = tunables(ContinuousBatching)
    assert knobs["max_num_seqs"].log and knobs["max_num_seqs"].low == 1
    assert "policy" not in knobs  # not declared: not searched

    with pytest.raises(ValueError, match="either low"):
        Tunable(low=1, choices=(1, 2))
    assert tunable(3, choices=(1, 3)).default == 3


def test_a_knob_of_an_option_exists_only_with_that_option(base: Any) -> None:
    space = SearchSpace.declared(base).narrowed(
        ["speculative=none,ngram", "speculative.num_speculative_tokens=2:3"], base
    )
    points = space.grid()
    assert {"speculative": "none"} in points
    assert {"speculative": "ngram", "speculative.num_speculative_tokens": 2} in points
    assert len(points) == 3  # none, ngram x {2, 3}: the draft length never without ngram
    # optuna's define-by-run draws agree
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    for _ in range(20):
        point = space.suggest(study.ask())
        assert ("speculative.num_speculative_tokens" in point) == (point["speculative"] == "ngram")


def test_every_drawn_point_composes_and_the_invalid_ones_are_infeasible(
    home: Path, base: Any, tmp_path: Path
) -> None:
    opts = tune.parse_args(["--slo", "ttft:1000", "--out", str(tmp_path)])
    tuner = tune.Tuner(opts)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    reasons = []
    for _ in range(12):
        point = tuner.space.suggest(study.ask())
        overrides = SearchSpace.overrides(point)
        compose_config(overrides)  # the space never yields an override Hydra refuses
        graph, _layout, reason = tuner.check(overrides)
        assert (graph is None) == bool(reason)
        if graph is not None:
            assert graph.batching.max_num_seqs == point["batching.max_num_seqs"]
        else:
            reasons.append(reason)
            assert "\n" not in reason
    # the base's own executor values share the base's step-time model
    assert (
        tuner.model.executor_key({"executor.precision": "fp32", "batching.max_num_seqs": 2}) == ()
    )
    assert tuner.model.executor_key({"executor.precision": "int8"}) == ("executor.precision=int8",)
    # max_num_batched_tokens below max_num_seqs is what task=check refuses
    _, _, reason = tuner.check(["batching.max_num_seqs=128", "batching.max_num_batched_tokens=64"])
    assert reason.startswith("batching.max_num_batched_tokens:")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1:64:log", Tunable(low=1, high=64, log=True)),
        ("2:8", Tunable(low=2, high=8)),
        ("fp32,int8", Tunable(choices=("fp32", "int8"))),
        ("4,8,16", Tunable(choices=(4, 8, 16))),
        ("true", Tunable(choices=(True,))),
    ],
)
def test_space_ranges_parse(text: str, expected: Tunable) -> None:
    assert parse_range("k", text) == expected


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (["batching.max_num_seqs=8:2"], "HIGH < LOW"),
        (["batching.max_num_seqs=0:8:log"], "LOW >= 1"),
        (["batching.max_num_seqs=a:b"], "integers"),
        (["batching.max_num_seqs=1:2:lin"], "LOW:HIGH:log"),
        (["batching.nope=1:2"], "no such key"),
        (["server.host"], "not a declared knob"),
        (["cache=prefix,lru"], "unknown option lru"),
        (["speculative.num_speculative_tokens=1:4"], "exists with speculative=ngram only"),
    ],
)
def test_space_errors_are_one_line(base: Any, items: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        SearchSpace.declared(base).narrowed(items, base)
    assert "\n" not in str(info.value)


def test_undeclared_key_of_the_config_may_be_searched(base: Any) -> None:
    space = SearchSpace.declared(base).narrowed(["server.max_waiting_requests=64,128"], base)
    assert space.grid() == [
        {"server.max_waiting_requests": 64},
        {"server.max_waiting_requests": 128},
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--slo", "ttfb:10"],
        ["--slo", "ttft:-1"],
        [],  # no SLO
        ["--slo", "ttft:10", "--bogus"],
        ["--slo", "ttft:10", "--max-concurrency", "0"],
        ["--slo", "ttft:10", "--slo-attainment", "1.5"],
        ["--slo", "ttft:10", "--name", "a/b"],
        ["--slo", "ttft:10", "--space", "batching.max_num_seqs=x"],
        ["--slo", "ttft:10", "batching.max_num_seqs=0"],
        ["--slo", "ttft:10", "experiment.servers=0"],
        ["--slo", "ttft:10", "nokey"],
        # what an option sets, set otherwise in the base config: refused, not overridden
        ["--slo", "ttft:10", "experiment.repeats=5"],
        ["--slo", "ttft:10", "+experiment.goodput={ttft: 20}"],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(
    home: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert tune.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("inferflow tune: ") and "\n" not in err, err


# ------------------------------------------------------------------ the engine model


def _synthetic() -> CostModel:
    return CostModel((0.004, 0.002, 0.0002, 0.0))


def test_simulator_more_seqs_less_queueing_at_high_load(home: Path) -> None:
    load = Workload(
        num_prompts=48, input_len=64, output_len=32, request_rate=math.inf, max_concurrency=None
    )
    p99 = {}
    for seqs in (2, 8, 32):
        graph = build_graph(compose_config([f"batching.max_num_seqs={seqs}"]))
        figures = simulate(graph, load, _synthetic(), {"ttft": 1000.0})
        assert figures["completed"] == 48 and figures["failed"] == 0
        p99[seqs] = figures["p99_ttft_ms"]
    assert p99[2] > p99[8] > p99[32]  # the scheduler admits more at once: less queueing


def test_simulator_is_deterministic_for_a_seed(home: Path) -> None:
    graph = build_graph(compose_config(["batching.max_num_seqs=4"]))
    load = Workload(
        num_prompts=24, input_len=32, output_len=16, request_rate=30.0, max_concurrency=None, seed=7
    )
    one = simulate(graph, load, _synthetic(), {"tpot": 50.0})
    two = simulate(graph, load, _synthetic(), {"tpot": 50.0})
    assert one == two
    other = simulate(graph, Workload(**{**load.__dict__, "seed": 8}), _synthetic(), {"tpot": 50.0})
    assert other["duration"] != one["duration"]  # another arrival process


def test_cost_model_fit_recovers_the_step_times() -> None:
    truth = (0.003, 0.001, 0.0001, 0.002)
    samples = [
        ((1.0, float(r), float(t), c), sum(a * b for a, b in zip(truth, (1, r, t, c), strict=True)))
        for r in (1, 4, 16)
        for t in (16, 64, 512)
        for c in (0.1, 1.0)
    ]
    fitted = CostModel.fit(samples)
    assert fitted.coef == pytest.approx(truth, abs=1e-9)


@pytest.mark.parametrize("rate", [20.0, 60.0])  # below and past the queue's edge
def test_calibration_recovers_the_scale_and_overhead_of_the_run_it_measured(
    home: Path, monkeypatch: pytest.MonkeyPatch, rate: float
) -> None:
    """The default's short run is replayed as it was sent (its prompts and arrivals, not the
    full workload's): a "measured" run made by the model with step times x1.6 and 80 ms per
    request gives back x1.6 and 80 ms, also where requests queue."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    cost = CostModel((0.004, 0.002, 0.0002, 0.0))
    monkeypatch.setattr(
        tune_model, "profile_engine", lambda graph, **kw: Profile(cost, seconds=0.0)
    )
    argv = ["--slo", "ttft:1000", "--request-rate", str(rate), "--num-prompts", "48",
            "--input-len", "32", "--output-len", "16"]  # fmt: skip
    tuner = tune.Tuner(tune.parse_args(argv), log=lambda m: None)
    tuner.model.profile(())
    short = {**tuner.workload, "num_prompts": 16}
    graph = build_graph(compose_config([]))
    measured = simulate(graph, Workload.of(short), cost.scaled(1.6), overhead_s=0.08)
    tuner.model.calibrate(measured, short)
    assert tuner.model.scale == pytest.approx(1.6, rel=0.02)
    assert tuner.model.overhead_s == pytest.approx(0.08, abs=0.005)


def test_a_point_whose_executor_was_not_profiled_says_which_profile_ranked_it(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--max-profiles 1: the base is timed; int4's points borrow the base's step times, and the
    prediction (trials.csv's step_profile) and the log say so, once."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    timed: list[str] = []

    def profile_engine(graph: Any, **kw: Any) -> Profile:
        timed.append(str(graph.config.executor.precision))
        return Profile(CostModel((0.004, 0.002, 0.0002, 0.0)), seconds=0.0)

    monkeypatch.setattr(tune_model, "profile_engine", profile_engine)
    logged: list[str] = []
    argv = ["--slo", "ttft:1000", "--request-rate", "10", "--num-prompts", "8", "--max-profiles",
            "1", "--space", "executor.precision=fp32,int4"]  # fmt: skip
    tuner = tune.Tuner(tune.parse_args(argv), log=logged.append)
    base, _ = tuner.model.predict({}, [])
    assert base["step_profile"] == "base"
    int4 = {"executor.precision": "int4"}
    for _ in range(2):
        predicted, reason = tuner.model.predict(int4, ["executor.precision=int4"])
        assert reason == "" and predicted["step_profile"] == "base"
    assert timed == ["fp32"]  # one profile: the base's
    notes = [m for m in logged if m.startswith("no step profile for executor.precision=int4")]
    assert len(notes) == 1 and "--max-profiles 1" in notes[0]


# ------------------------------------------------------------------ the +tuned=NAME file


def test_tuned_file_composes_as_plus_tuned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path))
    path = tune.write_tuned(
        "mine",
        [
            "cache=none",
            "speculative=ngram",
            "batching.max_num_seqs=8",
            "speculative.num_speculative_tokens=3",
            "executor.precision=int8",
        ],
        ["a header line"],
    )
    assert path == tmp_path / "conf" / "tuned" / "mine.yaml"
    assert path.read_text().startswith("# @package _global_\n# a header line\n")
    cfg = compose_config(["+tuned=mine"])
    assert cfg.cache._target_.endswith("NoPrefixCache")
    assert cfg.speculative.num_speculative_tokens == 3
    assert cfg.batching.max_num_seqs == 8 and cfg.executor.precision == "int8"
    # the command line still wins over the tuned file
    assert compose_config(["+tuned=mine", "batching.max_num_seqs=2"]).batching.max_num_seqs == 2


# ------------------------------------------------------------------ the search, measured by a stand-in


def model_measure(
    cost: CostModel,
    calls: list[tuple[list[str], int]],
    *,
    failing: str | None = None,
    faster: str | None = None,
) -> tune.Measure:
    """A served measurement played by the engine model (each call recorded in ``calls`` with
    its number of prompts): a point with the override ``failing`` "does not start", one with
    ``faster`` takes 0.75 of the modelled step times (what only a real run would show)."""

    def measure(
        overrides: Sequence[str],
        workload: Mapping[str, Any],
        goodput: Mapping[str, float],
        repeats: int,
        warmup: int,
        log_dir: Path,
    ) -> dict[str, Any]:
        calls.append((list(overrides), int(workload["num_prompts"])))
        if failing is not None and failing in overrides:
            return {"task": "bench", "failed": "server did not start: boom"}
        graph = build_graph(compose_config(list(overrides)))
        scale = 0.75 if faster is not None and faster in overrides else 1.0
        figures = simulate(graph, Workload.of(workload), cost.scaled(scale), goodput)
        # repeats that vary by 3 % each way: a spread and a prediction interval, as served.py's
        values = [figures["request_goodput"] * (1 + 0.03 * k) for k in (-1, 0, 1)][:repeats]
        spread = {"request_goodput": Spread.of(values).to_dict()}
        return {"task": "bench", "repeats": repeats, **figures, "figures": spread}

    return measure


def test_search_measures_the_promising_points_and_records_failures(
    home: Path, home_conf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole search with the served measurement replaced by the engine model itself (a
    point with max_num_seqs 3 "fails to start"): short runs, confirmations, the files."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    cost = CostModel((0.004, 0.002, 0.0002, 0.0))
    monkeypatch.setattr(
        tune_model, "profile_engine", lambda graph, **kw: Profile(cost, seconds=0.0)
    )
    calls: list[tuple[list[str], int]] = []
    stand_in = model_measure(cost, calls, failing="batching.max_num_seqs=3")

    out = tmp_path / "out"
    argv = [
        "--slo",
        "ttft:300",
        "tpot:40",
        "--request-rate",
        "inf",
        "--max-concurrency",
        "32",
        "--num-prompts",
        "36",
        "--input-len",
        "32",
        "--output-len",
        "16",
        "--space",
        "batching.max_num_seqs=1,2,3,16,32",
        "--sim-trials",
        "20",
        "--top",
        "5",
        "--budget-s",
        "1000",
        "--out",
        str(out),
        "--name",
        "standin",
    ]
    tuner = tune.Tuner(tune.parse_args(argv), measure=stand_in, log=lambda m: None)
    report = tuner.run()
    short = [c for c in calls if c[1] == 12]
    confirm = [c for c in calls if c[1] == 36]
    assert short and confirm and len(confirm) < len(short)  # successive halving
    assert confirm[0][0] == []  # the default, confirmed in the same run
    states = {t.label: t.state for t in tuner.trials}
    assert "failed" in states.values()  # recorded, not "slow"
    assert report["winner"]["overrides"] in (
        ["batching.max_num_seqs=16"],
        ["batching.max_num_seqs=32"],
    )
    assert report["goodput_ratio"] is not None and report["goodput_ratio"] >= 1.0
    assert isinstance(report["clear_win"], bool)  # judged against the runs' spread
    assert report["past_capacity"] is False  # a closed loop (--request-rate inf): no rate to miss
    assert isinstance(report["tied_with_winner"], list)
    assert report["binding_slo"]["slo"] in ("ttft", "tpot")
    tuned = home_conf / "tuned" / "standin.yaml"
    assert tuned.is_file() and (out / "tuned.yaml").read_text() == tuned.read_text()
    rows = (out / "trials.csv").read_text().splitlines()
    assert rows[0].startswith("trial,label,state,batching.max_num_seqs")
    assert len(rows) == len(tuner.trials) + 1
    assert "server did not start" in (out / "trials.csv").read_text()
    saved = json.loads((out / "report.json").read_text())
    assert saved["reproduce"].startswith("inferflow tune ") and "--seed 0" in saved["reproduce"]
    assert (out / "report.md").read_text().startswith("# inferflow tune: standin")


def test_knobs_the_model_cannot_see_are_decided_by_short_runs(
    home: Path, home_conf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """API processes and speculation are invisible to the engine model (every value predicts
    the same): the simulated search keeps them at the base's values, then the best short
    point gets a short run with each of their other values, and one that serves more wins."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    cost = CostModel((0.004, 0.002, 0.0002, 0.0))
    monkeypatch.setattr(
        tune_model, "profile_engine", lambda graph, **kw: Profile(cost, seconds=0.0)
    )
    # two API processes serve a third more (what only a real run can show)
    stand_in = model_measure(cost, [], faster="server.num_api_servers=2")

    # SLOs every point meets: goodput is throughput, so the faster point is the better one
    argv = ["--slo", "ttft:100000", "--request-rate", "inf", "--max-concurrency", "32",
            "--num-prompts", "36", "--input-len", "32", "--output-len", "16",
            "--space", "batching.max_num_seqs=2,16", "server.num_api_servers=1,2",
            "speculative=none,ngram", "--sim-trials", "12", "--top", "2", "--budget-s", "5000",
            "--out", str(tmp_path / "out"), "--name", "unmodelled"]  # fmt: skip
    tuner = tune.Tuner(tune.parse_args(argv), measure=stand_in, log=lambda m: None)
    assert [k.key for k in tuner.space.unmodelled()] == ["speculative", "server.num_api_servers"]
    assert tuner.variant_count() == 2
    report = tuner.run()
    simulated = [t for t in tuner.trials if t.predicted]
    assert simulated and all(
        "server.num_api_servers" not in t.point and "speculative" not in t.point for t in simulated
    )
    variants = [t for t in tuner.trials if not t.predicted and t.label != "default"]
    assert sorted(
        o for t in variants for o in t.overrides if o.startswith(("server.", "speculative"))
    ) == ["server.num_api_servers=2", "speculative=ngram"]
    assert all(t.measured.get("short") for t in variants)
    assert "server.num_api_servers=2" in report["winner"]["overrides"]


# ------------------------------------------------------------------ the real command


@pytest.mark.server
@pytest.mark.slow
def test_inferflow_tune_end_to_end_on_the_tiny_model(
    home: Path, home_conf: Path, tmp_path: Path
) -> None:
    pytest.importorskip("inferflow.experiment.served")
    out = tmp_path / "out"
    env = {
        **os.environ,
        "PYTHONPATH": pythonpath(base=dict(os.environ)),
        "INFERFLOW_HOME": str(home),
    }
    args = [
        "tune",
        "tracing=off",
        "--slo",
        "ttft:2000",
        "tpot:200",
        "--max-concurrency",
        "4",
        "--num-prompts",
        "9",
        "--input-len",
        "16",
        "--output-len",
        "8",
        "--space",
        "batching.max_num_seqs=2,8",
        "--sim-trials",
        "4",
        "--top",
        "1",
        "--repeats",
        "1",
        "--budget-s",
        "120",
        "--name",
        "e2e",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "inferflow", *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=580,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "winner:" in proc.stdout and "+tuned=e2e" in proc.stdout
    tuned = home_conf / "tuned" / "e2e.yaml"
    assert tuned.read_text().startswith("# @package _global_")
    report = json.loads((out / "report.json").read_text())
    assert report["default"].get("request_goodput") is not None
    assert report["clear_win"] is None  # one repeat: no interval to call the win clear by
    assert (out / "trials.csv").is_file()
    # the summary of everything tried: the default and each measured point, short and confirm
    summary = report["summary"]
    with Path(summary["csv"]).open() as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) >= 2 and {"default short", "default confirm"} <= {r["run"] for r in rows}
    assert Path(summary["md"]).read_text().startswith("## inferflow tune e2e")
    assert Path(summary["png"]).read_bytes().startswith(b"\x89PNG")
    check = subprocess.run(
        [sys.executable, "-m", "inferflow", "+tuned=e2e", "task=check"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert check.returncode == 0, check.stderr


def test_the_serve_command_keeps_the_config_and_drops_how_it_was_measured() -> None:
    from inferflow.experiment.tune_report import serve_command

    opts = tune.parse_args(["experiment.servers=3", "+model=local", "model.path=/m", "task=bench",
                            "--slo", "ttft:100", "--name", "x"])  # fmt: skip
    assert serve_command(opts) == "python -m inferflow +model=local model.path=/m +tuned=x"


def test_points_inside_the_winners_interval_are_reported_as_tied() -> None:
    """A measured point whose goodput lies in the winner's 95 % prediction interval cannot be
    ranked below it at these repeats: the report names it; a rate past what the winner serves
    is called out (past capacity goodput depends on the arrival draw)."""
    from inferflow.experiment.tune_report import tie_and_capacity_notes

    def trial(number: int, values: list[float], served: float) -> tune_trial.Trial:
        spread = Spread.of(values)
        result = {"request_goodput": spread.mean, "request_throughput": served,
                  "figures": {"request_goodput": spread.to_dict()}}  # fmt: skip
        return tune_trial.Trial(
            number, {}, [f"k={number}"], f"t{number}", measured={"confirm": result}
        )

    winner = trial(1, [3.0, 3.2, 3.1], served=3.4)  # interval 3.1 ± 0.50
    close, far = trial(2, [2.7, 2.8, 2.9], served=3.3), trial(3, [1.0, 1.1, 1.2], served=2.0)
    assert tune_trial.within_interval(winner, close.measured["confirm"], "confirm")
    assert not tune_trial.within_interval(winner, far.measured["confirm"], "confirm")
    alone = trial(4, [3.0], served=3.0)  # one repeat: no interval
    assert not tune_trial.within_interval(alone, close.measured["confirm"], "confirm")
    assert tune_trial.goodput_interval(alone, "confirm") is None
    mean, half = tune_trial.goodput_interval(winner, "confirm") or (0.0, 0.0)
    assert mean == pytest.approx(3.1) and half == pytest.approx(0.497, abs=0.001)
    notes = tie_and_capacity_notes({
        "tied_with_winner": [{"overrides": close.overrides, "request_goodput": 2.8}],
        "past_capacity": True,
    })  # fmt: skip
    assert "Not separable from the winner" in notes[0] and "`k=2` (2.8)" in notes[0]
    assert "fewer requests per second than arrive" in notes[1]
    assert tie_and_capacity_notes({"tied_with_winner": [], "past_capacity": False}) == []


def test_of_tied_goodputs_the_point_furthest_inside_the_slos_wins(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a fixed rate every point that meets the SLOs serves what arrives: goodputs within 2 %
    are a tie, and the winner is the one with the most margin to its binding SLO; a point
    clearly ahead wins whatever its margin."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    tuner = tune.Tuner(
        tune.parse_args(["--slo", "ttft:1000", "tpot:50", "--request-rate", "3"]),
        log=lambda m: None,
    )

    def trial(number: int, goodput: float, ttft: float, tpot: float) -> tune_trial.Trial:
        result = {"request_goodput": goodput, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot}
        return tune_trial.Trial(
            number, {}, [f"k={number}"], f"t{number}", measured={"confirm": result}
        )

    edgy = trial(1, 2.90, ttft=900.0, tpot=20.0)  # 90 % of the TTFT limit
    roomy = trial(2, 2.86, ttft=400.0, tpot=30.0)  # 60 % of the TPOT limit
    worse = trial(3, 2.50, ttft=100.0, tpot=10.0)
    assert measured_winner([edgy, roomy, worse], "confirm", tuner.opts.slos) is roomy
    ahead = trial(4, 3.00, ttft=950.0, tpot=45.0)
    assert measured_winner([edgy, roomy, ahead], "confirm", tuner.opts.slos) is ahead


def test_slo_attainment_constrains_the_measured_winner_too(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--slo-attainment 0.95``: a point whose measured goodput is higher but whose share of
    requests inside the SLOs (goodput / throughput) is under 95 % does not win; when no point
    attains it, the best one still wins and the log says it misses."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    opts = tune.parse_args(
        ["--slo", "ttft:1000", "--request-rate", "3", "--slo-attainment", "0.95"]
    )
    slos, need = opts.slos, opts.attainment

    def trial(number: int, goodput: float, served: float) -> tune_trial.Trial:
        result = {"request_goodput": goodput, "request_throughput": served, "p99_ttft_ms": 500.0}
        return tune_trial.Trial(
            number, {}, [f"k={number}"], f"t{number}", measured={"confirm": result}
        )

    busy = trial(1, 2.60, served=3.00)  # 87 % of its requests good
    tidy = trial(2, 2.40, served=2.45)  # 98 %
    assert measured_winner([busy, tidy], "confirm", slos, need) is tidy
    assert attains(tidy, "confirm", need) and not attains(busy, "confirm", need)
    worse = trial(3, 2.00, served=2.90)  # 69 %
    logged: list[str] = []
    assert measured_winner([busy, worse], "confirm", slos, need, logged.append) is busy
    assert logged == [
        "no measured point has 95% of its requests inside the SLOs (--slo-attainment): "
        "the winner is the best that misses it"
    ]


def test_a_confirmation_on_several_servers_is_budgeted_for_each_start_and_warm_up(
    home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short run (a start, a warm-up and a load of a third of the prompts) is three units; a
    confirmation is a start and a full warm-up per server and ``--repeats`` full loads: with
    three servers it costs more, and fewer candidates get short runs in the same budget."""
    monkeypatch.setenv("INFERFLOW_HOME", str(home))
    # (a space of knobs the model sees: no short runs for measured-only knobs to budget)
    argv = ["--slo", "ttft:1000", "--request-rate", "3", "--num-prompts", "96", "--repeats", "3",
            "--budget-s", "700", "--space", "batching.max_num_seqs"]  # fmt: skip

    def tuner(*extra: str) -> tune.Tuner:
        return tune.Tuner(tune.parse_args([*extra, *argv]), log=lambda m: None)

    one, three = tuner(), tuner("experiment.servers=3")
    # units of 10 s: one server 1x(1 + 3) + 3x3 = 13 units, three servers 3x(1 + 3) + 3x3 = 21
    assert one.confirm_cost(30.0) == pytest.approx(130.0)
    assert three.confirm_cost(30.0) == pytest.approx(210.0)
    assert tuner("experiment.servers=9").confirm_cost(30.0) == pytest.approx(210.0)  # <= repeats
    # 700 s: one server, 6 short runs (180 s) and 3 confirmations (390 s); three servers, 3
    assert (one._how_many(30.0), three._how_many(30.0)) == (6, 3)
    # knobs only real runs decide: their other values on the best point (3 + 3 short runs,
    # 180 s) come out of the model's picks: 4 short runs and 2 confirmations fit
    unseen = tuner("--space", "server.num_api_servers=1:4", "cache.block_size")
    assert unseen.variant_count() == 6 and unseen._how_many(30.0) == 4
