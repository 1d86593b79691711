"""``inferflow bench`` / ``python -m inferflow.bench``: the load generator's command line.

Option names follow ``vllm bench serve`` (``--random-input-len`` and friends are accepted as
aliases of the shorter names), so existing invocations carry over.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import fields
from pathlib import Path
from typing import TypeVar

import httpx

from inferflow.bench.client import EndpointSpec
from inferflow.bench.datasets import DATASET_NAMES, DatasetConfig, build_dataset
from inferflow.bench.fit import WORD_TOKENS, fit_to_context, served_max_model_len
from inferflow.bench.metrics import GOODPUT_NAMES, METRIC_NAMES, compute_metrics, detailed_fields
from inferflow.bench.records import SampleRequest
from inferflow.bench.report import default_filename, format_table, run_header, save_result
from inferflow.bench.runner import LoadConfig, run_load_sync
from inferflow.bench.text import make_text_source
from inferflow.bench.tokenizer_lookup import TokenCounting, choose_token_counting

C = TypeVar("C", DatasetConfig, LoadConfig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="inferflow bench",
        description="Load generator for OpenAI-compatible servers (vLLM bench serve metrics).",
    )
    g = p.add_argument_group("server")
    g.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default="/v1/completions")
    g.add_argument("--backend", choices=["openai", "openai-chat"], help="default: from --endpoint")
    g.add_argument("--model", help="model id; default: the first of GET /v1/models")
    g.add_argument("--served-model-name", help="name sent in requests (default: --model)")
    g.add_argument("--header", nargs="*", default=[], metavar="KEY=VALUE")
    g.add_argument("--timeout", type=float, default=6 * 3600.0, help="per-request seconds")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", choices=DATASET_NAMES, default="random")
    g.add_argument("--dataset-path", help="JSONL file for --dataset-name jsonl")
    g.add_argument("--num-prompts", type=int)
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int)
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    g.add_argument(
        "--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0
    )
    g.add_argument("--prefix-len", "--random-prefix-len", dest="prefix_len", type=int)
    g.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: system prompts")
    g.add_argument("--num-docs", type=int, help="long-doc: distinct documents (default: one each)")
    g.add_argument(
        "--tokenizer",
        help="tokenizer.json (or a folder holding it); default: --model when it is a local "
        "folder, else the served checkpoint's when it is on this machine, else words",
    )
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf = all at once")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int)
    g.add_argument("--num-warmups", type=int, default=0)
    g.add_argument("--request-id-prefix", default="bench-")
    g = p.add_argument_group("request")
    g.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send ignore_eos (default: on for the random dataset, as in vLLM)",
    )
    g.add_argument(
        "--force-output-len",
        action="store_true",
        help="also send min_tokens = max_tokens so every output has its set length",
    )
    g.add_argument(
        "--no-stream-usage",
        action="store_true",
        help="do not send stream_options.include_usage (count chunks instead)",
    )
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into bodies")
    g = p.add_argument_group("metrics and output")
    g.add_argument("--percentile-metrics", default=",".join(METRIC_NAMES))
    g.add_argument("--metric-percentiles", default="90,99")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50")
    g.add_argument("--label")
    g.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")
    g.add_argument("--save-result", action="store_true")
    g.add_argument("--save-detailed", action="store_true", help="add per-request arrays")
    g.add_argument("--append-result", action="store_true")
    g.add_argument("--result-dir")
    g.add_argument("--result-filename")
    g.add_argument("--disable-tqdm", action="store_true")
    return p


def parse_pairs(items: list[str], sep: str, what: str) -> dict[str, str]:
    out = {}
    for item in items:
        key, found, value = item.partition(sep)
        if not found or not key.strip():
            raise ValueError(f"{what} must look like KEY{sep}VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {k: float(v) for k, v in parse_pairs(items or [], ":", "--goodput").items()}
    for name, value in slos.items():
        if name not in GOODPUT_NAMES or value < 0:
            raise ValueError(f"--goodput: {name}:{value} (names {GOODPUT_NAMES}, values >= 0 ms)")
    return slos


def fetch_first_model(base_url: str, headers: dict[str, str]) -> str:
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ConnectionError(f"could not read the model from {base_url}/v1/models: {exc}") from exc


def endpoint_from_args(args: argparse.Namespace, dataset: str) -> tuple[EndpointSpec, str]:
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = parse_pairs(args.header, "=", "--header")
    model = args.model or fetch_first_model(base_url, headers)
    backend = args.backend or ("openai-chat" if "chat" in args.endpoint else "openai")
    sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k}
    extra = {k: v for k, v in sampling.items() if v is not None}
    extra.update(args.extra_body or {})
    spec = EndpointSpec(
        api_url=base_url + args.endpoint,
        model=args.served_model_name or model,
        chat=backend == "openai-chat",
        ignore_eos=args.ignore_eos if args.ignore_eos is not None else dataset == "random",
        force_output_len=args.force_output_len,
        include_usage=not args.no_stream_usage,
        extra_body=extra,
        extra_headers=headers,
    )
    return spec, model


def make_samples(
    args: argparse.Namespace, dataset: DatasetConfig, spec: EndpointSpec, model: str
) -> tuple[list[SampleRequest], TokenCounting]:
    """The run's requests, their lengths counted as ``choose_token_counting`` decides and a
    default input length fitted to the server's context."""
    base_url = spec.api_url[: -len(args.endpoint)]
    counting = choose_token_counting(
        args.tokenizer, args.model, base_url, spec.model, spec.extra_headers
    )
    if counting.warning:
        print(counting.warning, file=sys.stderr)
    context = served_max_model_len(base_url, model, spec.extra_headers)
    fitted = fit_to_context(dataset, context, 1 if counting.tokenizer else WORD_TOKENS)
    if fitted.input_len != dataset.input_len:
        print(
            f"inferflow bench: the server's max_model_len is {context}: prompts of "
            f"{fitted.input_len} {'tokens' if counting.tokenizer else 'words'} (pass "
            "--input-len to choose)",
            file=sys.stderr,
        )
    return build_dataset(fitted, make_text_source(counting.tokenizer)), counting


def config_from_args(cls: type[C], args: argparse.Namespace, **option_of: str) -> C:
    """A bench config dataclass from the options of its fields' names (``option_of``: field ->
    option name, where they differ)."""
    return cls(**{f.name: getattr(args, option_of.get(f.name, f.name)) for f in fields(cls)})


def run_from_args(args: argparse.Namespace) -> dict[str, object]:
    """Build the dataset, run the load, print (and save, if asked) the result dict (vLLM
    layout) and return it."""
    result, failures = measure_from_args(args)
    if failures:
        print(f"{len(failures)} request(s) failed; first errors:", file=sys.stderr)
        for error in failures[:5]:
            print(f"  {error}", file=sys.stderr)
    print(format_table(result, *metric_options(args)))
    if args.save_result or args.append_result:
        name = args.result_filename or default_filename(result)
        path = Path(args.result_dir or ".") / name
        save_result(result, path, append=args.append_result)
        print(f"results written to {path}")
    return result


def metric_options(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """``--percentile-metrics`` and ``--metric-percentiles`` as lists."""
    names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    return names, [float(p) for p in args.metric_percentiles.split(",") if p.strip()]


def measure_from_args(args: argparse.Namespace) -> tuple[dict[str, object], list[str]]:
    """Build the dataset, run the load and compute its figures: the result dict (vLLM layout)
    and the failed requests' errors. Prints nothing but notes on token counting (stderr);
    ``task=bench`` measures served configs with it."""
    dataset = config_from_args(DatasetConfig, args, name="dataset_name", path="dataset_path")
    metric_names, percentiles = metric_options(args)
    goodput = parse_goodput(args.goodput)
    spec, model = endpoint_from_args(args, dataset.name)
    samples, counting = make_samples(args, dataset, spec, model)
    load = config_from_args(LoadConfig, args, timeout_s="timeout")
    run = run_load_sync(spec, samples, load)
    result = run_header(
        backend="openai-chat" if spec.chat else "openai",
        label=args.label,
        model_id=model,
        tokenizer_id=counting.name,
        num_prompts=len(samples),
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        metadata={
            "dataset_name": dataset.name,
            "token_counting": counting.label,
            **parse_pairs(args.metadata, "=", "--metadata"),
        },
    )
    result.update(compute_metrics(run.records, run.duration, percentiles, goodput, metric_names))
    if args.save_detailed:
        result.update(detailed_fields(run.records))
    return result, [r.error for r in run.records if not r.success]


def main(argv: list[str] | None = None) -> int:
    """Exit code: 0 when at least one request completed, 1 when none did or the server is
    unreachable, 2 for bad arguments."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        result = run_from_args(args)
    except (ValueError, FileNotFoundError, ConnectionError) as exc:
        print(f"inferflow bench: error: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, ConnectionError) else 2
    completed = result["completed"]
    return 0 if isinstance(completed, int) and completed > 0 else 1
