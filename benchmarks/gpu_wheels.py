#!/usr/bin/env python
"""The wheel folder the GPU test machine needs (step 1 of ``gpu_check.sh``, run on this machine).

The GPU machine has no internet access; its image holds torch, triton, transformers, onnx and
many common packages (``IMAGE_PACKAGES``, from the device notes, KINDS.md), but not all of
inferflow's dependencies. This walks inferflow's requirements (without extras) through the
installed distributions' metadata, keeps those the image lacks, and downloads each, at the
version installed here (the one the tests ran with), as a CPython 3.12 manylinux x86-64 wheel
(``pip download --no-deps --only-binary=:all:``). The manylinux tags are given up to
``manylinux_2_31``: pip matches a tag exactly, and llguidance >= 1.9 ships only
``manylinux_2_31`` wheels (with older tags only, pip would fail on the pinned version, or pick
an old release if unpinned). Packages published only as sources (antlr4-python3-runtime 4.9.3)
are built into a wheel with ``pip wheel``. The folder must stay under ``--limit-mib`` (40): the
device run carries at most 64 MiB with the working tree.

    python benchmarks/gpu_wheels.py --dest .whl     # then: run(carry=[".whl"], ...) on the GPU
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

# the GPU image's packages (KINDS.md, "Python packages already there", read 2026-11-17)
_IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp
"""
IMAGE_PACKAGES = frozenset(_IMAGE.split())
SOURCE_ONLY = {"antlr4-python3-runtime"}  # no wheel on PyPI: built here
PLATFORMS = [
    "manylinux_2_31_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_requirements(root: str = "inferflow") -> dict[str, str]:
    """name -> version (installed here) of ``root``'s dependencies, transitively, without
    extras, that the GPU image lacks."""
    found: dict[str, str] = {}
    todo = [Requirement(r) for r in md.requires(root) or [] if "extra ==" not in r]
    seen: set[str] = set()
    while todo:
        req = todo.pop()
        name = norm(req.name)
        if name in seen or (req.marker and not req.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError as exc:
            raise SystemExit(f"{req.name} is not installed here: install inferflow first") from exc
        if name not in IMAGE_PACKAGES:
            found[name] = dist.version
        todo += [Requirement(r) for r in dist.requires or []]
    return dict(sorted(found.items()))


def download(name: str, version: str, dest: Path) -> None:
    pip = [sys.executable, "-m", "pip"]
    if name in SOURCE_ONLY:
        cmd = [*pip, "wheel", "--no-deps", "-q", "-w", str(dest), f"{name}=={version}"]
    else:
        cmd = [
            *pip,
            "download",
            "--no-deps",
            "-q",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "--implementation",
            "cp",
            "--abi",
            "cp312",
            "--abi",
            "abi3",
            "--abi",
            "none",
            *[x for p in PLATFORMS for x in ("--platform", p)],
            "-d",
            str(dest),
            f"{name}=={version}",
        ]
    subprocess.run(cmd, check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=Path(".whl"))
    ap.add_argument("--limit-mib", type=float, default=40.0)
    ap.add_argument(
        "--list", action="store_true", help="print what would be fetched, fetch nothing"
    )
    args = ap.parse_args()
    wanted = missing_requirements()
    if args.list:
        for name, version in wanted.items():
            print(f"{name}=={version}")
        return 0
    if args.dest.exists():
        shutil.rmtree(args.dest)
    args.dest.mkdir(parents=True)
    for name, version in wanted.items():
        download(name, version, args.dest)
    wheels = sorted(args.dest.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    (args.dest / "REQUIREMENTS.txt").write_text("".join(f"{n}=={v}\n" for n, v in wanted.items()))
    print(f"{len(wheels)} wheels for {len(wanted)} packages, {size:.1f} MiB in {args.dest}")
    if len(wheels) != len(wanted):
        print("a package gave no wheel", file=sys.stderr)
        return 1
    if size > args.limit_mib:
        print(f"over the {args.limit_mib} MiB limit", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
