"""Where the torch engine's compiled artifacts live: ``<engine_dir>/torch-<key>/``.

The key hashes what determines the compiled code, like the ONNX engine's (``engine_cache.py``):
the weights' digest, this builder's version, the torch (and Triton) version, the dtype, the
device architecture and the compile mode. Inside, ``inductor/`` and ``triton/`` hold Inductor's
own caches (FX graph and AOTAutograd caches, generated C++/Triton kernels), which Inductor keys
and verifies itself; ``manifest.json`` records the key's fields once a load completed. A second
start with the same key finds the manifest (``reused``) and Inductor loads the compiled graphs
instead of compiling them.
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from inferflow.json_types import JSONObject
from inferflow.lora.adapter import LoraSpec
from inferflow.models.checkpoint import Checkpoint
from inferflow.runtimes.config import TorchSettings, default_engine_dir
from inferflow.runtimes.engine_cache import MANIFEST, cache_key

TORCH_ENGINE_VERSION = "2"  # bump when the forward or the compile setup changes (2: biases, rope types)


def device_arch(device: torch.device) -> str:
    """``cpu-x86_64-AVX2`` or ``cuda-sm90-NVIDIA H200``: what the generated kernels target."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda-sm{major}{minor}-{torch.cuda.get_device_name(device)}"
    return f"cpu-{platform.machine()}-{torch.backends.cpu.get_cpu_capability()}"


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except ImportError:
        return None


@dataclass
class TorchEngineDir:
    path: Path
    fields: JSONObject
    reused: bool
    _committed: bool = field(default=False, repr=False)

    def use_for_compiler_caches(self) -> None:
        """Point Inductor's and Triton's caches here (read by them when they compile)."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.path / "inductor")
        os.environ["TRITON_CACHE_DIR"] = str(self.path / "triton")

    def commit(self) -> None:
        """Record a completed load (so the next start reports ``reused``)."""
        if self.reused or self._committed:
            return
        manifest = {"key": self.path.name.removeprefix("torch-"), "fields": self.fields,
                    "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        tmp = self.path / f"{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2))
        tmp.replace(self.path / MANIFEST)
        self._committed = True


def engine_fields(checkpoint: Checkpoint, settings: TorchSettings,
                  device: torch.device, lora: LoraSpec | None = None) -> JSONObject:
    """The key's fields; a LoRA engine's add its ``LoraSpec`` (one without: today's key)."""
    fields: JSONObject = {
        "weights_digest": checkpoint.weights_digest,
        "builder_version": TORCH_ENGINE_VERSION,
        "torch_version": torch.__version__,
        "triton_version": _triton_version(),
        "dtype": settings.dtype,
        "device_arch": device_arch(device),
        "compile": settings.compile,
        "architecture": checkpoint.config.architecture,
    }
    if lora is not None:
        fields.update(lora.cache_fields())  # type: ignore[arg-type]
    return fields


def open_engine_dir(checkpoint: Checkpoint, settings: TorchSettings, device: torch.device,
                    lora: LoraSpec | None = None) -> TorchEngineDir:
    fields = engine_fields(checkpoint, settings, device, lora)
    root = Path(settings.cache_dir).expanduser() if settings.cache_dir else default_engine_dir()
    path = root / f"torch-{cache_key(fields)}"
    path.mkdir(parents=True, exist_ok=True)
    try:
        reused = json.loads((path / MANIFEST).read_text()).get("fields") == fields
    except (OSError, ValueError):
        reused = False
    return TorchEngineDir(path, fields, reused)
