"""One load of ``inferflow bench`` against a served config, as ``task=bench`` and ``inferflow
tune`` send it (:func:`one_load`): where it goes (:class:`Client`), the bench's options for a
workload (:func:`bench_argv`) and the check that refuses a workload the bench would refuse before
any server starts (:func:`check_load`)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import httpx
from omegaconf import DictConfig, OmegaConf

from inferflow.bench.cli import build_parser, config_from_args, measure_from_args, parse_goodput
from inferflow.bench.datasets import DatasetConfig
from inferflow.bench.runner import LoadConfig
from inferflow.config import ConfigError
from inferflow.config.schema import WorkloadConfig

# numbers of a bench result that are its setup (the workload records them), not figures
SETUP_KEYS = frozenset({"num_prompts", "request_rate", "burstiness", "max_concurrency"})


@dataclasses.dataclass(frozen=True)
class Client:
    """Where the load goes, the bearer token it sends (None: no key) and the tokenizer that
    counts its lengths (None: ``inferflow bench``'s lookup)."""

    url: str
    api_key: str | None = None
    tokenizer: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def one_load(
    client: Client, load: Mapping[str, Any], slo: Mapping[str, float], tag: str
) -> tuple[dict[str, Any], list[str], int]:
    """One ``inferflow bench`` load: its vLLM result keys (numbers only), the failed
    requests' errors, the number completed. A server that stopped answering counts as every
    request failed."""
    args = bench_args(bench_argv(client, load, slo, tag))
    try:
        result, failures = measure_from_args(args)
    except (ConnectionError, httpx.HTTPError) as exc:
        return {}, [str(exc)], 0
    figures = {k: v for k, v in result.items() if _number(v) and k not in SETUP_KEYS}
    # "failed" is a failed point's reason in results.json; the count of failed requests
    # is recorded as "failed_requests"
    figures["failed_requests"] = figures.pop("failed", 0)
    return figures, failures, int(result.get("completed") or 0)  # type: ignore[call-overload]


def bench_argv(
    client: Client, load: Mapping[str, Any], slo: Mapping[str, float], tag: str
) -> list[str]:
    """``inferflow bench`` options for one load of ``load`` (a workload dict)."""
    argv = [
        "--base-url", client.url,
        "--dataset-name", str(load["dataset"]),
        "--num-prompts", str(load["num_prompts"]),
        "--input-len", str(load["input_len"]),
        "--output-len", str(load["output_len"]),
        "--request-rate", str(load["request_rate"]),
        "--burstiness", str(load["burstiness"]),
        "--seed", str(load["seed"]),
        "--request-id-prefix", f"bench-{tag}-",
        "--disable-tqdm",
    ]  # fmt: skip
    if load.get("max_concurrency"):
        argv += ["--max-concurrency", str(load["max_concurrency"])]
    if load.get("dataset_path") is not None:
        argv += ["--dataset-path", str(load["dataset_path"])]
    if load.get("range_ratio"):
        argv += ["--range-ratio", str(load["range_ratio"])]
    if load.get("prefix_len") is not None:
        argv += ["--prefix-len", str(load["prefix_len"])]
    if slo:
        argv += ["--goodput", *(f"{k}:{v}" for k, v in slo.items())]
    if client.api_key:
        argv += ["--header", f"Authorization=Bearer {client.api_key}"]
    if client.tokenizer:
        argv += ["--tokenizer", client.tokenizer]
    return argv


def bench_args(argv: list[str]) -> argparse.Namespace:
    """``inferflow bench``'s parsed options; one it refuses is a
    :class:`~inferflow.config.ConfigError` (argparse's own message is on stderr)."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit:
        raise ConfigError(f"experiment.workload: inferflow bench refuses {argv[2:]}") from None


def check_load(load: Mapping[str, Any], slo: Mapping[str, float]) -> None:
    """Refuse a workload or SLOs ``inferflow bench`` would refuse, before a server starts
    (:class:`~inferflow.config.ConfigError`, one line)."""
    args = bench_args(bench_argv(Client("http://127.0.0.1:1"), load, slo, "check"))
    try:
        config_from_args(DatasetConfig, args, name="dataset_name", path="dataset_path").validate()
        config_from_args(LoadConfig, args, timeout_s="timeout").validate()
        parse_goodput(args.goodput)
    except ValueError as exc:
        raise ConfigError(f"experiment.workload / experiment.goodput: {exc}") from None


def recorded(load: Mapping[str, Any]) -> dict[str, Any]:
    """A workload as results record it: an unbounded rate is ``"inf"`` (JSON has no
    infinity), as in ``inferflow bench`` results."""
    rate = load.get("request_rate")
    return {**load, "request_rate": "inf" if rate == math.inf else rate}


def workload_dict(workload: WorkloadConfig | Mapping[str, Any]) -> dict[str, Any]:
    """A workload (schema dataclass, DictConfig or dict) as a plain dict with every field."""
    given: Mapping[str, Any]
    if isinstance(workload, WorkloadConfig):
        given = dataclasses.asdict(workload)
    elif isinstance(workload, DictConfig):
        given = OmegaConf.to_container(workload, resolve=True)  # type: ignore[assignment]
    else:
        given = workload
    fields = {f.name for f in dataclasses.fields(WorkloadConfig)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ConfigError(f"experiment.workload: unknown key(s) {unknown}; known: {sorted(fields)}")
    return {**dataclasses.asdict(WorkloadConfig()), **given}


@contextlib.contextmanager
def quiet_http() -> Iterator[None]:
    """No INFO line per HTTP request from httpx (a run's log, stdout in a run, stays readable:
    the results JSON is what it prints)."""
    logger = logging.getLogger("httpx")
    level = logger.level
    logger.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        logger.setLevel(level)


def server_info(client: Client) -> dict[str, Any]:
    """The served engine and model as ``/version`` describes them (empty when it does not)."""
    with contextlib.suppress(httpx.HTTPError, ValueError):
        response = httpx.get(f"{client.url}/version", headers=client.headers(), timeout=10.0)
        if response.status_code == 200:
            body = response.json()
            return {"engine": body.get("engine"), "model": body.get("model")}
    return {}


def first_line(failures: Sequence[str]) -> str:
    return (str(failures[0]).splitlines() or ["no error given"])[0] if failures else "unknown"


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
