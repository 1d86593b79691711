"""Weight digests are reused while a file is unchanged and recomputed when it changes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from inferflow.models import digest_cache, safetensors_reader
from inferflow.models.digest_cache import VERIFY_ENV, cached_file_digest


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Path]:
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(VERIFY_ENV, raising=False)
    reads: list[Path] = []

    def counting(path: Path, chunk: int = 1 << 22) -> str:
        reads.append(path)
        return safetensors_reader.file_digest(path, chunk)

    monkeypatch.setattr(digest_cache, "file_digest", counting)
    return reads


def test_an_unchanged_file_is_hashed_once(counted: list[Path], tmp_path: Path) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"weights" * 1000)
    expected = hashlib.sha256(f.read_bytes()).hexdigest()
    assert cached_file_digest(f) == expected and cached_file_digest(f) == expected
    assert len(counted) == 1


def test_a_rewritten_file_is_hashed_again_even_with_the_old_size_and_mtime(
    counted: list[Path], tmp_path: Path
) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"a" * 4096)
    first = cached_file_digest(f)
    stat = f.stat()
    f.write_bytes(b"b" * 4096)  # same size
    os.utime(f, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # and the old mtime: ctime still moves
    assert cached_file_digest(f) == hashlib.sha256(b"b" * 4096).hexdigest() != first
    assert len(counted) == 2


def test_verify_on_demand_rehashes(
    counted: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x" * 100)
    cached_file_digest(f)
    monkeypatch.setenv(VERIFY_ENV, "1")
    cached_file_digest(f)
    assert len(counted) == 2


def test_an_unwritable_cache_is_no_error(
    counted: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("INFERFLOW_HOME", str(blocker))
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"y" * 10)
    assert cached_file_digest(f) == hashlib.sha256(b"y" * 10).hexdigest()
