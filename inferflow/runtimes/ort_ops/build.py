"""Compiling the custom ops into a shared library, cached by content like compiled engines.

``<engine dir>/ops/<key>/`` holds ``libinferflow_ort_ops.so``, the sources it was built from
(``src/``) and ``build.json``. The key hashes what determines the binary: the source bytes, the
headers' C API version, the compiler's version, the flags and the CPU's vector extensions (the
library picks its AVX-512 / AVX2 / portable kernels at run time, but a rebuild on another CPU
costs little and keeps a cache folder honest about where it was made). A build goes to a
temporary sibling folder and is renamed into place (two processes may build at once: the first
rename wins, the other uses it); a folder left by a killed build is removed by the next one.

:func:`paged_attention_library` is memoised per process (failures too) and raises
:class:`OpUnavailable` with a one-line reason; :func:`op_status` is its (available, reason) form
for the executor's single warning line. ``INFERFLOW_ORT_OP=off`` makes the op unavailable.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from inferflow.paths import inferflow_home
from inferflow.runtimes.ort_ops import headers

LIBRARY = "libinferflow_ort_ops.so"
MANIFEST = "build.json"
SOURCE_DIR = Path(__file__).resolve().parent
# paged_attention.cc is the translation unit; it #includes the others (the kernel_* ones per ISA)
SOURCES = ("paged_attention.cc", "kernel_job.cc", "kernel_vector.cc", "kernel_small.cc", "kernel_tile.cc")
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fvisibility=hidden",
         "-ffp-contract=fast",  # fused multiply-adds in the portable kernels (-std=c++17 turns it off)
         "-Wno-psabi")  # AVX vector arguments of inlined helpers: no ABI is exposed
CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512dq", "avx512vl")
BUILD_TIMEOUT_S = 600.0


class OpUnavailable(Exception):
    """The custom op cannot be built or loaded here; ``str()`` says why in one line."""


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path  # the .so
    key: str
    reused: bool  # found in the cache (False: compiled by this call)
    build_seconds: float  # of the build that made it


def disabled_reason() -> str | None:
    value = os.environ.get("INFERFLOW_ORT_OP", "").strip().lower()
    if value in ("off", "0", "false", "no", "disabled"):
        return f"disabled by INFERFLOW_ORT_OP={os.environ['INFERFLOW_ORT_OP']}"
    return None


def default_engine_dir() -> Path:
    """The compiled-engine folder; the same rule as ``runtimes.config.default_engine_dir``
    (not imported: this package stays a leaf)."""
    if env := os.environ.get("INFERFLOW_ENGINE_DIR"):
        return Path(env).expanduser()
    return inferflow_home() / "compiled_engines"


def compiler() -> list[str]:
    """``$CXX`` (may carry arguments), else the first of c++, g++, clang++ on PATH."""
    if env := os.environ.get("CXX"):
        return shlex.split(env)
    for name in ("c++", "g++", "clang++"):
        if found := shutil.which(name):
            return [found]
    raise OpUnavailable("no C++ compiler (install g++ or set CXX)")


@functools.cache
def compiler_version(command: tuple[str, ...]) -> str:
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OpUnavailable(f"the C++ compiler {' '.join(command)} does not run: {exc}") from exc
    if done.returncode != 0 or not done.stdout.strip():
        raise OpUnavailable(f"{' '.join(command)} --version failed: {done.stderr.strip()[:200]}")
    return done.stdout.strip().splitlines()[0]


def cpu_flags() -> list[str]:
    """The vector extensions of :data:`CPU_FLAGS` this CPU reports (Linux /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    line = next((ln for ln in text.splitlines() if ln.startswith(("flags", "Features"))), "")
    have = set(line.partition(":")[2].split())
    return [f for f in CPU_FLAGS if f in have]


def build_fields(include: Path, command: list[str], source_dir: Path = SOURCE_DIR) -> dict[str, object]:
    """Everything the key covers."""
    return {
        "sources": {name: hashlib.sha256((source_dir / name).read_bytes()).hexdigest() for name in SOURCES},
        "ort_api_version": headers.api_version(include),
        "compiler": compiler_version(tuple(command)),
        "flags": list(FLAGS),
        "cpu_flags": cpu_flags(),
        "machine": platform.machine(),
    }


def library_key(fields: dict[str, object]) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def _cached(entry: Path, key: str) -> dict[str, object] | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("key") == key and (entry / LIBRARY).stat().st_size > 0:
            return dict(manifest)
    except (OSError, ValueError):
        pass
    return None


def _remove_abandoned(ops_dir: Path, key: str) -> None:
    """``.<key>-<pid>-*`` folders of builds whose process is gone."""
    for folder in ops_dir.glob(f".{key}-*"):
        try:
            os.kill(int(folder.name.split("-")[1]), 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass


def build_library(engine_dir: Path | None = None, *, source_dir: Path = SOURCE_DIR,
                  fetch: bool = True) -> BuiltLibrary:
    """The cached library for the current sources, headers, compiler and CPU; compiled now
    when absent (not memoised: see :func:`paged_attention_library`)."""
    try:
        include = headers.ensure_headers(fetch=fetch)
    except headers.HeadersUnavailable as exc:
        raise OpUnavailable(str(exc)) from exc
    command = compiler()
    fields = build_fields(include, command, source_dir)
    key = library_key(fields)
    ops_dir = (engine_dir or default_engine_dir()) / "ops"
    entry = ops_dir / key
    if (manifest := _cached(entry, key)) is not None:
        return BuiltLibrary(entry / LIBRARY, key, True, float(str(manifest.get("build_seconds", 0))))
    try:
        ops_dir.mkdir(parents=True, exist_ok=True)
        _remove_abandoned(ops_dir, key)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-{os.getpid()}-", dir=ops_dir))
    except OSError as exc:
        raise OpUnavailable(f"cannot write the op's build folder under {ops_dir}: {exc}") from exc
    try:
        seconds = _compile(command, include, source_dir, tmp)
        manifest = {"key": key, **fields, "include": str(include), "build_seconds": round(seconds, 2),
                    "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        try:
            os.replace(tmp, entry)  # atomic publish; a concurrent builder may have won
        except OSError:
            if _cached(entry, key) is None:
                raise
    except OSError as exc:
        raise OpUnavailable(f"cannot write the op's library to {entry}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BuiltLibrary(entry / LIBRARY, key, False, seconds)


def _compile(command: list[str], include: Path, source_dir: Path, folder: Path) -> float:
    """Compile copies of the sources in ``folder/src`` (what was hashed is what is built)."""
    src = folder / "src"
    src.mkdir()
    for name in SOURCES:
        shutil.copyfile(source_dir / name, src / name)
    argv = [*command, *FLAGS, f"-I{include}", str(src / SOURCES[0]), "-o", str(folder / LIBRARY)]
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise OpUnavailable(f"compiling the op failed: {exc}") from exc
    if done.returncode != 0:
        tail = " | ".join(ln for ln in done.stderr.strip().splitlines()[-6:])
        raise OpUnavailable(f"compiling the op failed ({' '.join(argv[:1])} exit {done.returncode}): {tail}")
    return time.monotonic() - started


def check_loads(path: Path) -> str:
    """Load the library (ctypes) and register it in an ONNX Runtime SessionOptions, as a session
    will; returns the kernel set this CPU gets (avx512, avx2 or portable)."""
    import onnxruntime as ort

    try:
        isa = ctypes.CDLL(str(path)).InferflowPagedAttentionIsa
        isa.restype = ctypes.c_char_p
        name = isa().decode()
        ort.SessionOptions().register_custom_ops_library(str(path))
    except Exception as exc:  # OSError, AttributeError (no symbol), ORT's Fail (not a RuntimeError)
        raise OpUnavailable(f"ONNX Runtime {ort.__version__} cannot load {path}: {exc}") from exc
    return str(name)


@functools.cache
def _library_for(engine_dir: Path) -> Path | OpUnavailable:
    try:
        built = build_library(engine_dir)
        check_loads(built.path)
        return built.path
    except OpUnavailable as exc:
        return exc


def paged_attention_library(engine_dir: Path | None = None) -> Path:
    """The library holding ``inferflow.PagedAttention`` (``so.register_custom_ops_library``),
    built on first use; memoised per process and engine folder. Raises :class:`OpUnavailable`."""
    if reason := disabled_reason():
        raise OpUnavailable(reason)
    result = _library_for((engine_dir or default_engine_dir()).expanduser().resolve())
    if isinstance(result, OpUnavailable):
        raise OpUnavailable(str(result))
    return result


def op_status(engine_dir: Path | None = None) -> tuple[bool, str]:
    """(True, library path) or (False, why the op is unavailable)."""
    try:
        return True, str(paged_attention_library(engine_dir))
    except OpUnavailable as exc:
        return False, str(exc)
