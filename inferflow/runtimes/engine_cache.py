"""Compiled-engine cache: ``<engine_dir>/<key>/{model.onnx, model.onnx.data, manifest.json}``
(TensorRT's entries add ``engine.plan``).

The key hashes everything that determines the built file: the weights' digest, the graph-builder
version, the runtime versions (onnx, onnxruntime) and the engine settings. A second start with the
same inputs reuses the entry; any change gives a new key (a stale engine is never loaded). An entry
whose manifest or files do not verify is rebuilt, never crashed on.

The builder gets the entry's folder being built: a streaming builder writes its weights to
``model.onnx.data`` there as it goes and returns a skeleton model; an in-memory model is split
into the same two files here. Files are checked against the manifest's digests on every load,
but through ``digest_cache``: an unchanged file (path, size, inode, mtime, ctime) is not re-read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from inferflow.models.digest_cache import cached_file_digest, remember_digest
from inferflow.models.initializers import DATA_FILE, uses_external_data
from inferflow.models.safetensors_reader import file_digest
from inferflow.runtimes.build_progress import current_rss_bytes, peak_rss_bytes, reset_peak_rss

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
MODEL_FILE = "model.onnx"


@dataclass(frozen=True)
class CacheEntry:
    key: str
    path: Path
    manifest: dict[str, Any]
    reused: bool  # True when loaded from the cache, False when built now

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE


def cache_key(fields: dict[str, Any]) -> str:
    blob = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:24]


def _verify(entry: Path, key: str) -> dict[str, Any] | None:
    """The manifest when the entry is complete and intact, else None (with a log line why)."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("key") != key:
            raise ValueError("manifest key does not match")
        for name, meta in manifest["files"].items():
            f = entry / name
            if f.stat().st_size != meta["size"]:
                raise ValueError(f"{name} has the wrong size")
            if cached_file_digest(f) != meta["sha256"]:
                raise ValueError(f"{name} does not match its digest")
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("compiled engine %s is unusable (%s); rebuilding", entry, exc)
        return None


def _remove_abandoned_builds(engine_dir: Path, key: str) -> None:
    """Delete ``.<key>-<pid>-*`` folders of builds whose process is gone (killed mid-build: a
    streamed build leaves a partial data file of up to the engine's size)."""
    for folder in engine_dir.glob(f".{key}-*"):
        try:
            pid = int(folder.name.split("-")[1])
            os.kill(pid, 0)  # alive (or not ours to signal): a concurrent build, leave it
        except (ValueError, IndexError, ProcessLookupError):
            log.info("removing an abandoned engine build %s", folder)
            shutil.rmtree(folder, ignore_errors=True)
        except PermissionError:
            pass


def write_atomic(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole or not at all: written to a temporary file beside it,
    flushed to disk, then renamed over it (``os.replace``)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def get_or_build(engine_dir: Path, fields: dict[str, Any],
                 build: Callable[[Path], onnx.ModelProto],
                 finish: Callable[[Path], None] | None = None) -> CacheEntry:
    """Return the cached engine for ``fields``, building (and caching) it when absent or corrupt.

    ``build(folder)`` returns the model; it may already have written its external data to
    ``folder/model.onnx.data`` (``initializers.ExternalDataWriter``). ``finish(folder)``, when
    given, runs once the model files are saved there and before the manifest is made: the files
    it writes (TensorRT's ``engine.plan``) are in the manifest, with their digests, and published
    with the entry, never added to a published one.
    """
    key = cache_key(fields)
    entry = engine_dir / key
    if entry.exists():
        manifest = _verify(entry, key)
        if manifest is not None:
            log.info("reusing compiled engine %s", entry)
            return CacheEntry(key, entry, manifest, reused=True)
        shutil.rmtree(entry, ignore_errors=True)
    engine_dir.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(engine_dir, key)
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-{os.getpid()}-", dir=engine_dir))
    try:
        reset_peak_rss()  # the manifest's build_peak_rss_bytes is this build's
        rss_before = current_rss_bytes()
        model = build(tmp)
        if uses_external_data(model):  # streamed: the data file is written, the model is small
            onnx.save_model(model, tmp / MODEL_FILE)
        else:
            onnx.save_model(model, tmp / MODEL_FILE, save_as_external_data=True,
                            location=DATA_FILE, size_threshold=1024)
        del model
        if finish is not None:
            finish(tmp)
        files = {f.name: {"size": f.stat().st_size, "sha256": file_digest(f)} for f in sorted(tmp.iterdir())}
        manifest = {"key": key, **fields, "files": files, "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "build_seconds": round(time.time() - started, 3),
                    # the building process's RSS when the build began and its high-water mark
                    "build_rss_before_bytes": rss_before, "build_peak_rss_bytes": peak_rss_bytes()}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        try:
            os.replace(tmp, entry)  # atomic publish; a concurrent builder of the same key may win
        except OSError:
            if _verify(entry, key) is None:
                raise
        else:
            for name, meta in files.items():  # the next start does not hash them again
                remember_digest(entry / name, str(meta["sha256"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built compiled engine %s in %.1fs", entry, time.time() - started)
    return CacheEntry(key, entry, manifest, reused=False)
