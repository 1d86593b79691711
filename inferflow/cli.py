"""``python -m inferflow [OVERRIDES]`` and the ``inferflow`` console script.

``inferflow [OVERRIDES]`` composes the config with Hydra (``--cfg job``, ``--help``, ``--info``,
``-m`` work as usual), builds the serving graph and runs ``task`` (``serve`` by default).
Subcommands: ``inferflow traces FILE ...``, ``inferflow bench ...`` and ``inferflow tune ...``.

Exit codes: 0 ok, 1 runtime failure, 2 a config problem (printed as one line, no traceback),
130 (143) a run or a whole sweep stopped by Ctrl+C (SIGTERM): in a sweep (``-m``) the signal
stops the running job (its server drains) and no later job starts.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import signal
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from traceback import format_exc
from typing import Any

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from inferflow.compose import (
    CONF_SOURCE,
    CONFIG_NAME,
    prepare_overrides,
    register_resolvers,
    split_args,
)
from inferflow.compose import compose_config as compose_config  # (re-exported: cli's names)
from inferflow.config import (
    ConfigError,
    ExperimentConfig,
    Task,
    describe_omegaconf_error,
    typed_config,
)
from inferflow.dry_run import check
from inferflow.graph import ServingGraph, build_graph
from inferflow.interrupts import Interrupted as Interrupted  # (re-exported: cli's names)
from inferflow.interrupts import signal_of, signal_raises
from inferflow.models.errors import CheckpointError
from inferflow.stages.registry import register_configs

SUBCOMMANDS = {
    "traces": "inferflow.telemetry.trace_viewer",
    "bench": "inferflow.bench.cli",
    "tune": "inferflow.experiment.tune",
}
PROG = "inferflow"


class ComponentUnavailable(RuntimeError):
    """A part of inferflow this command needs is missing or failed (exit code 1, one line)."""


class MeasurementFailed(RuntimeError):
    """A measuring task recorded ``"failed"`` in its results (exit code 1; a sweep goes on)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of both ``python -m inferflow`` and the ``inferflow`` script."""
    args = list(sys.argv[1:] if argv is None else argv)
    warnings.formatwarning = _one_line_warning
    try:
        if args and args[0] in SUBCOMMANDS:
            return _subcommand(args[0], args[1:])
        return _run_hydra(args)
    except (ConfigError, ComponentUnavailable) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1


def _one_line_warning(
    message: Warning | str, category: type[Warning], *args: object, **kwargs: object
) -> str:
    """``inferflow: FutureWarning: ...`` instead of a file, a line number and a source line."""
    return f"{PROG}: {category.__name__}: {message}\n"


def _subcommand(name: str, argv: list[str]) -> int:
    module_name = SUBCOMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            raise ComponentUnavailable(
                f"'{PROG} {name}' needs {module_name}, which is not available"
            ) from None
        raise
    try:
        return int(module.main(argv) or 0)
    except BrokenPipeError:  # `inferflow traces FILE | head`: the reader left, end quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


def _run_hydra(args: list[str]) -> int:
    flags, overrides = split_args(args)
    overrides = prepare_overrides(overrides)
    if {"-m", "--multirun"} & set(flags) and not any(
        o.startswith("hydra.output_subdir=") for o in overrides
    ):
        overrides.append("hydra.output_subdir=.hydra")  # sweeps keep Hydra's record of each run
    register_configs()
    register_resolvers()
    failures: list[str] = []
    codes: list[int] = []

    def run_task(cfg: DictConfig) -> None:
        try:
            _task(cfg)
        except (ConfigError, CheckpointError, MeasurementFailed) as exc:  # Hydra adds its own lines
            label = f" [{', '.join(HydraConfig.get().overrides.task)}]" if _multirun() else ""
            failures.append(f"{PROG}{label}: {exc}")
            print(failures[-1], file=sys.stderr)
            codes.append(1 if isinstance(exc, MeasurementFailed) else 2)
            if not isinstance(exc, MeasurementFailed):
                _record_failed_point(cfg, str(exc))
        except Exception as exc:
            # anything else in one point of a measuring sweep (a bug, a plugin's error): that
            # point is recorded as failed with its traceback beside it, and the sweep goes on
            # to its other points and its summary (Hydra would stop at the first and skip both)
            if not (_multirun() and Task(cfg.task) in MEASURE_TASKS):
                raise
            where = _record_failed_point(cfg, f"{type(exc).__name__}: {exc}", with_traceback=True)
            label = ", ".join(HydraConfig.get().overrides.task)
            failures.append(f"{PROG} [{label}]: {type(exc).__name__}: {exc} (traceback: {where})")
            print(failures[-1], file=sys.stderr)
            codes.append(1)

    task = hydra.main(config_path=CONF_SOURCE, config_name=CONFIG_NAME, version_base="1.3")(
        run_task
    )
    saved_argv, saved_env = sys.argv, os.environ.get("HYDRA_FULL_ERROR")
    # Hydra would print its own multi-line report and exit 1; we want the exception instead.
    sys.argv, os.environ["HYDRA_FULL_ERROR"] = [PROG, *flags, *overrides], "1"
    try:
        task()
    except (ConfigCompositionException, OverrideParseException, OmegaConfBaseException) as exc:
        raise ConfigError(describe_hydra_error(exc)) from None
    except KeyboardInterrupt as exc:  # Ctrl+C, or SIGTERM (Interrupted): stop, sweep included
        sig = signal_of(exc)
        what = "the sweep was interrupted" if {"-m", "--multirun"} & set(flags) else "interrupted"
        tail = ": the running job stopped, no later job started" if "sweep" in what else ""
        print(f"{PROG}: {what} ({signal.Signals(sig).name}){tail}", file=sys.stderr)
        return 128 + sig
    finally:
        sys.argv = saved_argv
        if saved_env is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = saved_env
    return max(codes, default=0)


def _multirun() -> bool:
    return HydraConfig.get().mode == RunMode.MULTIRUN


def _plugin_hint(group: str, option: str) -> str:
    """How to get ``group=option`` when a plugin bundled in this checkout's ``plugins/`` has it."""
    plugins = Path(__file__).resolve().parents[1] / "plugins"
    for found in sorted(plugins.glob(f"*/*/conf/{group}/{option}.yaml")):
        folder = found.relative_to(plugins.parent).parts[:2]
        return (
            f" (it comes with the plugin in {'/'.join(folder)}: pip install -e {'/'.join(folder)})"
        )
    return ""


def describe_hydra_error(exc: Exception) -> str:
    """One line for a composition error: the key or group, and what is allowed."""
    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        if exc.options:
            hint = _plugin_hint(group, option)
            return f"{group}={option}: unknown option; available: {', '.join(exc.options)}{hint}"
        return (
            f"{group}={option}: no config '{exc.missing_cfg_file}' in the config search path "
            "(is the plugin installed, or its conf folder listed in INFERFLOW_CONFIG_PATH?)"
        )
    if isinstance(exc, OverrideParseException):
        return f"cannot parse override '{exc.override}': {exc.message.splitlines()[0]}"
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, OmegaConfBaseException):
        return str(describe_omegaconf_error(cause))
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    if text.startswith("Multiple values for "):  # Hydra's hint is for a defaults list, not here
        group = text.removeprefix("Multiple values for ").split(".")[0]
        several = "; several stages go in one list: '+stages=[a,b]'" if group == "stages" else ""
        return f"{group}: given more than once on the command line; it takes one option{several}"
    return text


# ---------------------------------------------------------------------- tasks


def _task(cfg: DictConfig) -> None:
    if Task(cfg.task) in MEASURE_TASKS or Task(cfg.task) is Task.check:
        typed_config(ExperimentConfig, cfg.get("experiment"), "experiment")  # its range checks
    graph = build_graph(cfg)
    if not graph.model.is_embedding:
        if not graph.config.get("models"):  # (a repository reports each model's own failure)
            graph.check_checkpoint()
        graph.check_engine_settings()  # what the worker would refuse, refused here in one line
        for note in graph.notes():
            logging.getLogger("inferflow").warning("inferflow: %s", note)
    out_dir = Path(HydraConfig.get().runtime.output_dir) if _multirun() else None
    if out_dir is not None:  # every sweep run records exactly what it ran
        (out_dir / "resolved_config.yaml").write_text(
            yaml.safe_dump(graph.to_container(), sort_keys=False)
        )
    task = Task(cfg.task)
    if task is Task.serve:
        serve(graph)
    elif task is Task.check:
        print(check(graph))
    else:
        _measure(task, graph, cfg, out_dir)


# The measuring tasks live in inferflow.experiment (a package above this one: reached by name).
MEASURE_TASKS = {
    Task.offline: "inferflow.experiment.offline",
    Task.bench: "inferflow.experiment.served",
}


def _measure(task: Task, graph: ServingGraph, cfg: DictConfig, out_dir: Path | None) -> None:
    """Run a measuring task; write its ``results.json`` (a sweep's run folder, or
    ``offline.output``) and print it. A result with ``"failed"`` raises
    :class:`MeasurementFailed` once written. SIGTERM stops it as Ctrl+C does (the task's
    ``finally`` blocks stop what it started, a served config's server included)."""
    module = importlib.import_module(MEASURE_TASKS[task])
    with signal_raises(signal.SIGTERM):
        results: dict[str, Any] = module.run(graph, cfg)
    _write_results(cfg, out_dir, results)
    if results.get("failed"):
        raise MeasurementFailed(f"failed: {results['failed']}")


def _write_results(cfg: DictConfig, out_dir: Path | None, results: dict[str, Any]) -> None:
    if out_dir is not None:  # a sweep's results say which point they measured
        results = {"overrides": list(HydraConfig.get().overrides.task), **results}
    output = cfg.offline.output or (str(out_dir / "results.json") if out_dir else None)
    text = json.dumps(results, indent=2)
    if output:
        Path(output).write_text(text + "\n")
    print(text)


def _record_failed_point(cfg: DictConfig, reason: str, with_traceback: bool = False) -> Path | None:
    """A sweep's measuring point refused or broken: its ``results.json`` says so (a summary
    lists it as failed); with ``with_traceback``, the exception being handled goes to
    ``traceback.txt`` beside it, whose path is returned."""
    if not _multirun() or Task(cfg.task) not in MEASURE_TASKS:
        return None
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results = {"overrides": list(HydraConfig.get().overrides.task), "task": str(cfg.task)}
    (out_dir / "results.json").write_text(
        json.dumps({**results, "failed": reason}, indent=2) + "\n"
    )
    if not with_traceback:
        return None
    (out_dir / "traceback.txt").write_text(format_exc())
    return out_dir / "traceback.txt"


def serve(graph: ServingGraph) -> None:
    """Hand the graph to the LitServe runtime (``inferflow.server.litserve.build.serve``).

    In a sweep (``-m``) a server stopped by SIGINT or SIGTERM stops the sweep: it drained, and
    :class:`Interrupted` keeps Hydra from starting the next job."""
    try:
        from inferflow.server.litserve.build import serve as serve_graph
    except ModuleNotFoundError as exc:
        if exc.name and "inferflow.server.litserve.build".startswith(exc.name):
            raise ComponentUnavailable(
                "the HTTP server (inferflow.server.litserve.build) is not available in this build; "
                "task=check validates the graph without serving"
            ) from None
        raise
    if str(getattr(graph.server, "runtime", "litserve")) == "ray":
        from inferflow.server.ray.host import serve_on_ray

        serve_on_ray(graph)
        return
    from inferflow.server.process.runtime import ServerFailed

    try:
        stopped_by = serve_graph(graph)
    except ServerFailed as exc:
        raise ComponentUnavailable(str(exc)) from None
    if stopped_by is not None and _multirun():
        raise Interrupted(stopped_by)
