"""What an engine build costs, and what a second start costs once it is cached.

    python benchmarks/engine_build.py                          # a generated 1B-shaped checkpoint
    python benchmarks/engine_build.py --checkpoint DIR --precision int4 --precision fp32
    python benchmarks/engine_build.py --shape 100m             # a quick run
    python benchmarks/engine_build.py --baseline-src /tmp/old  # also an older checkout, same run

For each precision, the server is started as a user starts it (``python -m inferflow
model.path=DIR executor.precision=P``) twice on an empty engine folder:

- first start: the build (time and peak RSS from the engine's ``manifest.json``, written by the
  worker that built it), the engine's size on disk, the worker's RSS high-water mark over build,
  load and warm-up (``VmHWM``), and the time to ``/ready``;
- later starts (``--restarts``, 3 by default; the median is reported): the time to ``/ready``
  with the engine cached, and the RSS of the idle worker and of the whole server 2 s after it is
  ready.

``--baseline-src`` runs the same starts with another inferflow source tree on ``PYTHONPATH``
(e.g. ``git worktree add /tmp/old <commit>``) for a before/after in one run; its manifest may
not record a build peak, so its worker's high-water mark is the figure to compare.

Writes ``benchmarks/results/engine_build/<checkpoint>.json`` and ``<checkpoint>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.suite import free_port, managed_server, server_pid, write_report  # noqa: E402
from inferflow.models.tiny import SPEC_100M, TinySpec, make_checkpoint  # noqa: E402
from inferflow.server.process_utils import descendants, process_rss  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "engine_build"
MiB = float(1 << 20)
# Llama-3.2-1B's layers (16 x hidden 2048, MLP 8192, 32 heads / 8 KV heads, tied embeddings)
# with a 32,000-token vocabulary: 1.04 B parameters, 3.9 GiB as fp32
SPEC_1B = TinySpec(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
                   num_kv_heads=8, vocab_size=32000, max_position_embeddings=2048,
                   tie_word_embeddings=True)
SHAPES = {"1b": SPEC_1B, "100m": SPEC_100M}


def checkpoint(args: argparse.Namespace) -> Path:
    if args.checkpoint is not None:
        return Path(args.checkpoint)
    path = Path(args.workdir) / f"llama-{args.shape}-{args.dtype}"
    if not (path / "tokenizer_config.json").exists():  # written last: a complete checkpoint
        print(f"generating {path} ...", flush=True)
        make_checkpoint(path, SHAPES[args.shape], seed=0, dtype=args.dtype)
    return path


def worker_pid(root: int) -> int | None:
    for pid in descendants(root):
        try:
            if Path(f"/proc/{pid}/comm").read_text().startswith("inferflow-llm"):
                return pid
        except OSError:
            continue
    return None


def high_water(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def start(ckpt: Path, precision: str, engines: Path, home: Path, src: Path | None,
          label: str) -> dict:
    """One server start: seconds to /ready, the worker's RSS high-water mark and idle RSS."""
    port = free_port()
    env = {"INFERFLOW_ENGINE_DIR": str(engines), "INFERFLOW_HOME": str(home)}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    cmd = [sys.executable, "-m", "inferflow", f"model.path={ckpt}", f"executor.precision={precision}",
           f"server.port={port}", "tracing=off"]
    started = time.perf_counter()
    # ``-m`` puts the working directory first on sys.path, before PYTHONPATH: run from ``src``
    with managed_server(cmd, port, OUT / "logs" / f"{label}.log", 3600, cwd=src, env=env):
        ready_s = time.perf_counter() - started
        root = server_pid(port)
        worker = worker_pid(root)
        assert worker is not None, "no engine worker"
        time.sleep(2.0)
        return {
            "ready_s": round(ready_s, 2),
            "worker_peak_rss_mib": round(high_water(worker) / MiB, 1),
            "worker_idle_rss_mib": round(process_rss(worker) / MiB, 1),
            "server_idle_rss_mib": round(sum(process_rss(p) for p in [root, *descendants(root)]) / MiB, 1),
        }


def measure(ckpt: Path, precision: str, workdir: Path, src: Path | None, label: str,
            restarts: int) -> dict:
    engines, home = workdir / f"engines-{label}", workdir / f"home-{label}"
    for folder in (engines, home):
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
    first = start(ckpt, precision, engines, home, src, f"{label}-first")
    (entry,) = [p for p in engines.iterdir() if (p / "manifest.json").exists()]
    manifest = json.loads((entry / "manifest.json").read_text())
    later = [start(ckpt, precision, engines, home, src, f"{label}-restart{i}") for i in range(restarts)]
    second = dict(sorted(later, key=lambda r: r["ready_s"])[len(later) // 2])  # the median start
    second["ready_s_all"] = [r["ready_s"] for r in later]
    engine_bytes = sum(meta["size"] for meta in manifest["files"].values())
    peak = manifest.get("build_peak_rss_bytes")
    return {
        "precision": precision,
        "source": str(src or REPO),
        "build_s": manifest.get("build_seconds"),
        "build_peak_rss_mib": None if peak is None else round(peak / MiB, 1),
        "engine_mib": round(engine_bytes / MiB, 1),
        "build_peak_minus_engine_mib": None if peak is None else round((peak - engine_bytes) / MiB, 1),
        "first_start": first,
        "second_start": second,
    }


def report(results: dict) -> str:
    rows = ["| source | precision | build s | build peak RSS | engine on disk | peak - engine | "
            "worker peak (build+load) | 1st start to /ready | later starts to /ready (median) | "
            "idle worker RSS | idle server RSS |", "|" + "---|" * 11]
    for r in results["runs"]:
        peak = "n/a" if r["build_peak_rss_mib"] is None else f"{r['build_peak_rss_mib']} MiB"
        margin = "n/a" if r["build_peak_minus_engine_mib"] is None else f"{r['build_peak_minus_engine_mib']} MiB"
        f, s = r["first_start"], r["second_start"]
        rows.append(f"| {r['label']} | {r['precision']} | {r['build_s']} | {peak} | {r['engine_mib']} MiB "
                    f"| {margin} | {f['worker_peak_rss_mib']} MiB | {f['ready_s']} s | {s['ready_s']} s "
                    f"| {s['worker_idle_rss_mib']} MiB | {s['server_idle_rss_mib']} MiB |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", type=Path, help="a Hugging Face checkpoint folder")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="storage type of the generated checkpoint")
    parser.add_argument("--precision", action="append", choices=["fp32", "fp16", "int8", "int4"])
    parser.add_argument("--baseline-src", type=Path, help="another inferflow source tree to compare")
    parser.add_argument("--restarts", type=int, default=3, help="starts with the engine cached")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/inferflow-bench-engine-build"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    ckpt = checkpoint(args)
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    runs = []
    for precision in args.precision or ["int4", "fp32"]:
        for label, src in (("baseline", args.baseline_src), ("this", None)):
            if label == "baseline" and src is None:
                continue
            print(f"{label} {precision} ...", flush=True)
            runs.append({"label": label, **measure(ckpt, precision, args.workdir, src,
                                                      f"{label}-{precision}", args.restarts)})
    results = {"checkpoint": str(ckpt), "checkpoint_mib": round(weights / MiB, 1),
               "cpus": os.cpu_count(), "runs": runs}
    (OUT / f"{ckpt.name}.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(OUT / f"{ckpt.name}.md", "# Engine builds\n\n" + report(results), [
        f"checkpoint: {ckpt} ({results['checkpoint_mib']} MiB of safetensors)",
        "build peak RSS: the building worker's high-water mark from the build's start (manifest); "
        "worker peak: its high-water mark over build, session load and warm-up (VmHWM)",
        "one machine, one run; the first start includes hashing the checkpoint once",
    ])


if __name__ == "__main__":
    main()
