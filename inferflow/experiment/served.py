"""``task=bench``: this config served over HTTP as a user runs it, loaded, measured.

``python -m inferflow -m +experiment=served_sweep`` (or ``task=bench OVERRIDES``) starts the
run's config as a server subprocess (``python -m inferflow OVERRIDES task=serve
server.host=127.0.0.1 server.port=FREE``, its output in ``<job dir>/server.log``) and sends the
load as soon as ``/ready`` first answers 200, as a load balancer would (no waiting for
background start-up work). Then ``experiment.warmup`` unmeasured passes of the whole workload
(fresh prompts; no measured repeat is a server's first full load, which near saturation varies
with the arrival draw: docs/experiments.md), and ``experiment.repeats`` measured loads of
``experiment.workload`` through :mod:`inferflow.bench` (each with its own seed, so the prefix
cache never serves a repeat from the one before), goodput counted against
``experiment.goodput``. The server is always stopped (its whole process group), on errors and
Ctrl+C too.

Figures are vLLM's ``bench serve`` result keys, but for the count of failed requests:
``failed_requests``. A server that does not start, or a load where every request failed, gives
a result with ``"failed": "<one line>"`` instead of figures: a sweep goes on and a tuner records
the point as infeasible. :func:`measure_served` is the same measurement for any list of
overrides (``inferflow tune`` calls it for one candidate). One load of the bench (its options,
the client, the checks before a server starts) is :mod:`~inferflow.experiment.served_load`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from inferflow.bench.suite import ServerStartError, free_port, managed_server
from inferflow.bench.tokenizer_lookup import TOKENIZER_FILE
from inferflow.compose import CONFIG_NAME
from inferflow.config import ConfigError
from inferflow.config.schema import WorkloadConfig
from inferflow.experiment.figures import MachineLoad, cpu_busy_pct_now
from inferflow.experiment.results import measured_result
from inferflow.experiment.served_load import (
    Client,
    check_load,
    first_line,
    one_load,
    quiet_http,
    recorded,
    server_info,
    workload_dict,
)
from inferflow.graph import ServingGraph

SERVER_LOG = "server.log"
# Overrides of the measuring run that the served config must not get: what it does (task),
# how it is measured (experiment.*, but not the +experiment=NAME file: it may set the config),
# where it listens (127.0.0.1, where the load comes from, on a free port) and Hydra's settings.
MEASURING_KEYS = ("task", "server.host", "server.port")
MEASURING_PREFIXES = ("experiment.", "hydra.")
WARMUP_SEED = 1_000_003  # warm-up prompts: seeds far from the measured repeats' ones


def run(graph: ServingGraph, cfg: DictConfig) -> dict[str, Any]:
    """Measure ``cfg`` served (see the module doc); ``graph`` was checked by the caller."""
    experiment = cfg.experiment
    with log_folder(cfg) as (log_dir, temporary):
        return measure_served(
            [*config_sources(), *HydraConfig.get().overrides.task],
            experiment.workload,
            experiment.goodput,
            int(experiment.repeats),
            int(experiment.warmup),
            float(experiment.max_spread),
            log_dir,
            float(experiment.server_timeout_s),
            quote_log=temporary,
            api_key=client_key(graph),
            tokenizer=served_tokenizer(cfg),
            servers=int(experiment.servers),
        )


def client_key(graph: ServingGraph) -> str | None:
    """The key the load sends when the served config wants one: an admin key (it also opens
    ``/version``), else an API key (``server.*_keys`` and ``$INFERFLOW_*_KEYS``)."""
    settings = graph.server.with_env_api_keys()
    keys = [*settings.admin_keys, *settings.api_keys]
    return keys[0] if keys else None


@contextlib.contextmanager
def log_folder(cfg: DictConfig) -> Iterator[tuple[Path, bool]]:
    """Where the server's log goes, and whether that folder is temporary: a sweep's run
    folder, else beside ``offline.output``, else (a plain run writes nothing) a folder that
    lives as long as the run."""
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN:
        yield Path(hydra.runtime.output_dir), False
    elif cfg.offline.output:
        yield Path(cfg.offline.output).resolve().parent, False
    else:
        with tempfile.TemporaryDirectory(prefix="inferflow-bench-") as tmp:
            yield Path(tmp), True


def config_sources() -> list[str]:
    """What made this run's config besides its overrides, for the served config's process:
    ``--config-dir`` and ``--config-name`` given on the command line, and
    ``hydra.searchpath`` (a user's own configs and stages; ``INFERFLOW_CONFIG_PATH`` reaches
    the server through its environment)."""
    hydra = HydraConfig.get()
    flags = [
        f"--config-dir={source.path.removeprefix('file://')}"
        for source in hydra.runtime.config_sources
        if source.provider == "command-line"
    ]
    if hydra.job.config_name and hydra.job.config_name != CONFIG_NAME:
        flags.append(f"--config-name={hydra.job.config_name}")
    return flags + [o for o in hydra.overrides.hydra if _key(o) == "hydra.searchpath"]


def _key(override: str) -> str:
    return override.lstrip("+~").split("=", 1)[0]


def serve_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides of a measuring run that make up the served config (without
    :data:`MEASURING_KEYS` and :data:`MEASURING_PREFIXES`; ``hydra.searchpath`` and the
    ``--config-*`` flags of :func:`config_sources` stay)."""

    def served(override: str) -> bool:
        key = _key(override)
        if key == "hydra.searchpath" or override.startswith("--config-"):
            return True
        return key not in MEASURING_KEYS and not key.startswith(MEASURING_PREFIXES)

    return [o for o in overrides if served(o)]


def measure_served(
    overrides: Sequence[str],
    workload: WorkloadConfig | Mapping[str, Any],
    goodput: Mapping[str, float],
    repeats: int,
    warmup: int,
    max_spread: float,
    log_dir: Path,
    timeout_s: float = 600.0,
    env: Mapping[str, str] | None = None,
    *,
    quote_log: bool = False,
    api_key: str | None = None,
    tokenizer: str | None = None,
    servers: int = 1,
) -> dict[str, Any]:
    """Serve the config of ``overrides`` and measure it under ``workload`` (see the module
    doc); the result of :func:`~inferflow.experiment.results.measured_result` with
    ``workload``, ``slo`` (the goodput SLOs, ms) and the server's ``engine`` and ``model``
    (``/version``), or ``{"task": "bench", "failed": "<one line>", ...}``.

    ``log_dir`` gets ``server.log``; ``timeout_s`` bounds the server's start; ``env`` adds to
    its environment; ``quote_log`` prints the log's end to stderr on a failure (when
    ``log_dir`` is about to be removed); ``api_key``: the bearer token the load sends (a
    config with API keys); ``tokenizer``: what counts the load's lengths (a folder holding a
    ``tokenizer.json``, see :func:`served_tokenizer`; None: ``inferflow bench``'s lookup). A
    workload or SLOs ``inferflow bench`` refuses raise
    :class:`~inferflow.config.ConfigError` before a server starts. KeyboardInterrupt is raised
    after the server stopped.

    ``servers`` > 1 spreads the repeats over that many fresh servers, one after another, each
    with its own warm-up (:func:`repeat_shares`): the spread then holds how much a new server's
    level varies, which one server's repeats cannot show. Logs: ``server.log``, then
    ``server-2.log``, ...
    """
    load = workload_dict(workload)
    slo = {str(k): float(v) for k, v in dict(goodput or {}).items()}
    check_load(load, slo)
    parts: list[_Part] = []
    reason = ""
    for index, share in enumerate(repeat_shares(repeats, servers)):
        log = Path(log_dir) / (SERVER_LOG if index == 0 else f"server-{index + 1}.log")
        done = sum(len(p.figures) for p in parts)
        seed = int(load.get("seed") or 0) + done  # every repeat its own prompts
        part = _serve_and_measure(overrides, {**load, "seed": seed}, slo, share, warmup, log,
                                  timeout_s, env, api_key, tokenizer)  # fmt: skip
        if part.failed:
            reason = part.failed
            if quote_log:
                print(log_tail(log), file=sys.stderr)
            break
        parts.append(part)
    if not reason:
        first = parts[0]
        extra = {"workload": recorded(load), "slo": slo, "tokenizer": first.tokenizer,
                 **({"servers": len(parts)} if len(parts) > 1 else {}), **first.info}  # fmt: skip
        return measured_result(
            "bench",
            [figures for p in parts for figures in p.figures],
            warmup=warmup,
            max_spread=max_spread,
            machine=MachineLoad.mean([p.machine for p in parts]),
            cpu_busy_before_pct=first.cpu_busy_before_pct,
            extra=extra,
        )
    return {
        "task": "bench",
        "failed": reason,
        "repeats": 0,
        "warmup": warmup,
        "workload": recorded(load),
        "slo": slo,
    }


def repeat_shares(repeats: int, servers: int) -> list[int]:
    """How many of ``repeats`` each server measures: as even as can be, the first ones one
    more, never a server without a repeat (``repeat_shares(3, 2) == [2, 1]``)."""
    repeats = max(1, repeats)
    servers = max(1, min(servers, repeats))
    return [repeats // servers + (1 if i < repeats % servers else 0) for i in range(servers)]


@dataclasses.dataclass
class _Part:
    """One server's share of a measured point: its repeats' figures and the machine's load
    during them, or why it failed."""

    figures: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    machine: MachineLoad = dataclasses.field(default_factory=MachineLoad)
    cpu_busy_before_pct: float | None = None
    tokenizer: str = ""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    failed: str = ""


def _serve_and_measure(
    overrides: Sequence[str],
    load: dict[str, Any],
    slo: dict[str, float],
    repeats: int,
    warmup: int,
    log: Path,
    timeout_s: float,
    env: Mapping[str, str] | None,
    api_key: str | None,
    tokenizer: str | None,
) -> _Part:
    """Start one server of ``overrides``, warm it up, measure ``repeats`` loads, stop it."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "inferflow",
        *serve_overrides(overrides),
        "task=serve",
        "server.host=127.0.0.1",
        f"server.port={port}",
        "hydra.mode=RUN",  # one server, whatever an experiment file says
    ]
    try:
        with quiet_http(), managed_server(cmd, port, log, timeout_s, env=env, settled=False) as url:
            return _measure(Client(url, api_key, tokenizer), load, slo, repeats, warmup)
    except ServerStartError as exc:
        return _Part(failed=f"the server did not start: {start_failure(str(exc), log)}")


def served_tokenizer(config: DictConfig) -> str | None:
    """The checkpoint folder of the LLM ``config`` serves, when it holds a ``tokenizer.json``:
    the load then counts its lengths in the server's tokens wherever the checkpoint lives
    (``inferflow bench`` alone finds only checkpoints in this machine's model folders). None
    for a model repository (which model a load reaches is the server's choice) or a model that
    cannot be found: the bench's own lookup decides, and says so."""
    from inferflow.config import ModelConfig
    from inferflow.models.lookup import resolve_model

    if config.get("models"):
        return None
    try:
        model = OmegaConf.to_object(config.model)
        if not isinstance(model, ModelConfig):
            return None
        folder, _ = resolve_model(model)
    except (ConfigError, ValueError, KeyError, TypeError, OSError):
        return None
    return str(folder) if (folder / TOKENIZER_FILE).is_file() else None


def tokenizer_of(overrides: Sequence[str]) -> str | None:
    """:func:`served_tokenizer` of the config ``overrides`` compose (outside a Hydra app:
    ``inferflow tune``, scripts); None when they do not compose."""
    from inferflow.compose import compose_config

    try:
        config = compose_config(serve_overrides(overrides))
    except Exception:  # any composition problem: the bench's lookup decides (and the server,
        return None  # started with the same overrides, reports the problem itself)
    return served_tokenizer(config)


def _measure(
    client: Client, load: dict[str, Any], slo: dict[str, float], repeats: int, warmup: int
) -> _Part:
    seed = int(load.get("seed") or 0)
    for i in range(warmup):  # the workload itself on other prompts, unmeasured
        warm = {**load, "seed": WARMUP_SEED + i}
        _, failures, completed = one_load(client, warm, slo, f"warmup{i}")
        if not completed:
            return _Part(failed=f"every warm-up request failed: {first_line(failures)}")
    part = _Part(cpu_busy_before_pct=cpu_busy_pct_now(0.5))
    with part.machine:
        for i in range(max(1, repeats)):
            load_i = {**load, "seed": seed + i}
            result, failures, completed = one_load(client, load_i, slo, f"r{i}")
            if not completed:
                return _Part(failed=f"every request of repeat {i + 1} failed: "
                                    f"{first_line(failures)}")  # fmt: skip
            part.figures.append(result)
    # what counted the load's lengths: the served checkpoint's tokenizer, else the bench's own
    # lookup (which may count words: see inferflow.bench.tokenizer_lookup)
    part.tokenizer = client.tokenizer or "inferflow bench lookup"
    part.info = server_info(client)
    return part


def start_failure(message: str, log: Path) -> str:
    """One line for a server that did not start: what happened and the log's last word on why
    (the ``inferflow: ...`` line of a refused config, else the last error line)."""
    head = message.splitlines()[0].rstrip(":") if message else "unknown"
    lines = [line.strip() for line in _read(log).splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("inferflow:")]
    errors = [line for line in lines if "Error" in line or "ERROR" in line]
    cause = (ours or errors or lines or [""])[-1]
    return f"{head}: {cause}" if cause else head


def log_tail(log: Path, lines: int = 20) -> str:
    text = _read(log).splitlines()
    return "\n".join([f"--- the end of {log.name}:", *text[-lines:]])


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
