"""ONNX Runtime's C/C++ headers, a build dependency of the custom ops (never committed).

Looked for in order: ``$INFERFLOW_ORT_INCLUDE``, ``/usr/include/onnxruntime`` (Debian's
``libonnxruntime-dev``), ``$INFERFLOW_HOME/ort_headers/<version>/``, then the default home's
(``~/.cache/inferflow/ort_headers/<version>/``: fetched once per machine, also seen by a process
whose ``$INFERFLOW_HOME`` points elsewhere, e.g. the test suite's). When none holds them they are
fetched: Debian trixie's ``libonnxruntime-dev`` package (85 kB, headers of ONNX Runtime 1.21, C API
21: the pip runtime serves older API versions), checked against its pinned sha256, unpacked in
pure Python (a .deb is an ``ar`` archive holding ``data.tar.xz``), only
``usr/include/onnxruntime/**`` kept, published atomically (temporary folder + rename).
Every failure is a :class:`HeadersUnavailable` with a one-line reason.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import re
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path, PurePosixPath

from inferflow.paths import inferflow_home

VERSION = "1.21.0"
PACKAGE_URL = ("http://deb.debian.org/debian/pool/main/o/onnxruntime/"
               "libonnxruntime-dev_1.21.0%2Bdfsg-1_amd64.deb")
PACKAGE_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
FETCH_TIMEOUT_S = 20.0
# what the op's source includes (onnxruntime_cxx_api.h pulls in the others)
REQUIRED = ("onnxruntime_c_api.h", "onnxruntime_cxx_api.h", "onnxruntime_cxx_inline.h",
            "onnxruntime_float16.h", "onnxruntime_lite_custom_op.h")
_PREFIX = PurePosixPath("usr/include/onnxruntime")
_MAX_PACKAGE_BYTES = 16 << 20


class HeadersUnavailable(Exception):
    """The headers are neither installed nor fetchable; ``str()`` says why."""


def fetched_dir() -> Path:
    """Where fetched headers live: ``$INFERFLOW_HOME/ort_headers/<version>/``."""
    return inferflow_home() / "ort_headers" / VERSION


def complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in REQUIRED)


def api_version(folder: Path) -> int:
    """``ORT_API_VERSION`` of the headers in ``folder``."""
    text = (folder / "onnxruntime_c_api.h").read_text(errors="replace")
    found = re.search(r"^#define ORT_API_VERSION (\d+)", text, re.MULTILINE)
    if found is None:
        raise HeadersUnavailable(f"{folder}/onnxruntime_c_api.h defines no ORT_API_VERSION")
    return int(found.group(1))


def find_headers() -> Path | None:
    """The first complete header folder of the search order, or None (nothing fetched)."""
    candidates = []
    if env := os.environ.get("INFERFLOW_ORT_INCLUDE"):
        candidates.append(Path(env).expanduser())
    candidates += [Path("/usr/include/onnxruntime"), fetched_dir(),
                   Path.home() / ".cache" / "inferflow" / "ort_headers" / VERSION]
    return next((c for c in candidates if complete(c)), None)


def ensure_headers(fetch: bool = True) -> Path:
    """The header folder, fetched into :func:`fetched_dir` if none is found and ``fetch``."""
    found = find_headers()
    if found is not None:
        return found
    env = os.environ.get("INFERFLOW_ORT_INCLUDE")
    if env:
        raise HeadersUnavailable(f"$INFERFLOW_ORT_INCLUDE={env} does not hold ONNX Runtime's headers "
                                 f"({', '.join(REQUIRED)})")
    if not fetch:
        raise HeadersUnavailable("ONNX Runtime's C/C++ headers are not installed (apt install "
                                 "libonnxruntime-dev, or set INFERFLOW_ORT_INCLUDE)")
    return fetch_headers()


def fetch_headers(url: str = PACKAGE_URL, timeout: float = FETCH_TIMEOUT_S) -> Path:
    """Download, verify and unpack the pinned package into :func:`fetched_dir`."""
    target = fetched_dir()
    if complete(target):
        return target
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            package = response.read(_MAX_PACKAGE_BYTES + 1)
    except (OSError, ValueError) as exc:  # URLError, timeouts and HTTP errors are OSErrors
        raise HeadersUnavailable(f"could not fetch ONNX Runtime's headers from {url}: {exc} "
                                 "(install libonnxruntime-dev or set INFERFLOW_ORT_INCLUDE)") from exc
    digest = hashlib.sha256(package).hexdigest()
    if digest != PACKAGE_SHA256:
        raise HeadersUnavailable(f"{url} has sha256 {digest}, expected {PACKAGE_SHA256}")
    files = _headers_from_deb(package)
    _publish(files, target)
    return target


def _ar_members(archive: bytes) -> dict[str, bytes]:
    """The members of a System V / GNU ``ar`` archive (a .deb's outer layer)."""
    if not archive.startswith(b"!<arch>\n"):
        raise HeadersUnavailable("the package is not an ar archive")
    members: dict[str, bytes] = {}
    at = 8
    while at + 60 <= len(archive):
        header = archive[at:at + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError as exc:
            raise HeadersUnavailable("the package has a corrupt ar header") from exc
        at += 60
        members[name] = archive[at:at + size]
        at += size + (size & 1)  # members are 2-byte aligned
    return members


def _headers_from_deb(package: bytes) -> dict[str, bytes]:
    """Relative path -> bytes of every regular file under ``usr/include/onnxruntime/``."""
    data = next((blob for name, blob in _ar_members(package).items() if name.startswith("data.tar")), None)
    if data is None:
        raise HeadersUnavailable("the package has no data.tar member")
    files: dict[str, bytes] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:  # xz, gz or plain: detected
            for member in tar.getmembers():
                name = member.name[2:] if member.name.startswith("./") else member.name
                path = PurePosixPath(name)
                if not member.isfile() or not path.is_relative_to(_PREFIX) or ".." in path.parts:
                    continue
                extracted = tar.extractfile(member)
                if extracted is not None:
                    files[str(path.relative_to(_PREFIX))] = extracted.read()
    except (tarfile.TarError, lzma.LZMAError, EOFError, OSError) as exc:
        raise HeadersUnavailable(f"the package's data archive is unreadable: {exc}") from exc
    missing = [name for name in REQUIRED if name not in files]
    if missing:
        raise HeadersUnavailable(f"the package lacks {', '.join(missing)}")
    return files


def _publish(files: dict[str, bytes], target: Path) -> None:
    """Write ``files`` into a temporary sibling of ``target`` and rename it into place; a
    concurrent fetcher that got there first wins (its copy is identical)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-{os.getpid()}-", dir=target.parent))
    try:
        for name, blob in files.items():
            path = tmp / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(blob)
        try:
            os.replace(tmp, target)
        except OSError:
            if not complete(target):
                raise
    except OSError as exc:
        raise HeadersUnavailable(f"could not write the headers to {target}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
