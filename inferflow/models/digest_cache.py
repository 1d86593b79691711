"""Weight digests that are not recomputed on every start when the files have not changed.

A checkpoint's identity (``Checkpoint.weights_digest``, part of the compiled-engine cache key) is
a sha256 over its files, and a cached engine's files are checked against the digests in its
manifest: for multi-GB files, seconds of reading on every start. Each
file's digest is therefore kept in ``$INFERFLOW_HOME/digests/`` against the file's identity as
the filesystem reports it (resolved path, size, inode, ``mtime_ns`` and ``ctime_ns``; the last
changes on any write and cannot be set back by the writer), and reused while that identity is
unchanged. ``INFERFLOW_VERIFY_DIGESTS=1`` rehashes every file (on demand, e.g. after restoring a
backup that kept timestamps). A cache that cannot be written is skipped, never an error.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from inferflow.models.safetensors_reader import file_digest
from inferflow.paths import inferflow_home

logger = logging.getLogger(__name__)

VERIFY_ENV = "INFERFLOW_VERIFY_DIGESTS"


def _identity(path: Path) -> dict[str, int | str]:
    st = path.stat()
    return {
        "path": str(path),
        "size": st.st_size,
        "inode": st.st_ino,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def _entry(path: Path) -> Path:
    return inferflow_home() / "digests" / f"{hashlib.sha256(str(path).encode()).hexdigest()}.json"


def cached_file_digest(path: Path) -> str:
    """sha256 of ``path``'s bytes, from the cache while the file's identity is unchanged."""
    path = path.resolve()
    identity = _identity(path)
    entry = _entry(path)
    if os.environ.get(VERIFY_ENV, "") not in ("1", "true", "yes"):
        try:
            saved = json.loads(entry.read_text())
            if saved.get("identity") == identity:
                return str(saved["sha256"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
    digest = file_digest(path)
    if _identity(path) != identity:  # changed while being read: do not remember it
        return digest
    _save(entry, identity, digest)
    return digest


def remember_digest(path: Path, digest: str) -> None:
    """Record ``digest`` for ``path`` as it is now (a file just written and hashed under another
    name, e.g. an engine published by renaming its folder, is then not read again)."""
    path = path.resolve()
    _save(_entry(path), _identity(path), digest)


def _save(entry: Path, identity: dict[str, int | str], digest: str) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"identity": identity, "sha256": digest}))
        os.replace(tmp, entry)
    except OSError as exc:
        logger.debug("cannot cache the digest of %s: %s", entry, exc)
