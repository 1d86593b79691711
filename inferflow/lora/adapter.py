"""A PEFT LoRA adapter as the engine uses it (``adapter_config.json`` + ``adapter_model.safetensors``).

:func:`load_peft_adapter` reads a folder ``save_pretrained`` wrote and checks it against the base
model and the engine's :class:`LoraSpec`; whatever the engines would not compute exactly as
``peft.PeftModel`` does (DoRA, trained biases, embedding or lm_head targets, per-module ranks,
...) is refused in one line naming the feature.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from inferflow.models.errors import CheckpointError
from inferflow.models.safetensors_reader import SafetensorsFile

if TYPE_CHECKING:
    from inferflow.models.config import ModelArch

# the projections an adapter may target, in the order the engines apply them (PEFT's names)
LORA_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj")


class LoraError(ValueError):
    """An adapter that cannot be served here; ``field`` is the request or config field to name
    in a 400 (``lora_path``, ``lora_name``, ``model``, ``lora.adapters.NAME``)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class LoraSpec:
    """The engine's LoRA shape, fixed when the engine is built (part of its cache key).

    ``max_loras`` slots (adapters resident in the engine at once, the adapters one step can mix),
    each of rank ``max_lora_rank`` (a smaller rank is zero-padded: exact), on ``targets`` (a
    subset of :data:`LORA_TARGETS`, in that order)."""

    max_loras: int
    max_lora_rank: int
    targets: tuple[str, ...] = LORA_TARGETS

    def cache_fields(self) -> dict[str, object]:
        return {"lora_max_loras": self.max_loras, "lora_max_rank": self.max_lora_rank,
                "lora_targets": ",".join(self.targets)}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter's weights, ready to be written into an engine slot.

    ``weights[(layer, target)] = (A, B)``: ``A`` (d_in, r) and ``B`` (r, d_out) float32, the
    transposes of PEFT's ``lora_A.weight`` (r, d_in) and ``lora_B.weight`` (d_out, r), so a
    target's output gains ``scaling * (x @ A @ B)``. A (layer, target) the adapter does not train
    is absent (its slot columns stay zero). ``scaling`` is ``lora_alpha / r`` (rsLoRA:
    ``lora_alpha / sqrt(r)``).
    """

    name: str
    path: Path
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(repr=False)
    base_model: str | None = None  # adapter_config.json's base_model_name_or_path

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# adapter_config.json keys whose non-empty / true value changes the math the engines compute
# (``y += scaling * x @ A @ B`` on whole q/k/v/o/gate/up/down projections): refused, named
_REFUSED_KEYS: dict[str, str] = {
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "rank_pattern (per-module ranks)",
    "alpha_pattern": "alpha_pattern (per-module alphas)",
    "lora_bias": "lora_bias (a trained bias on lora_B)",
    "target_parameters": "target_parameters (LoRA on raw parameters, e.g. MoE experts)",
    "trainable_token_indices": "trainable_token_indices (trained embedding rows)",
    "layer_replication": "layer_replication",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_qalora": "QA-LoRA (use_qalora)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D-style weights)",
}
_Fail = Callable[[str], "LoraError"]  # message -> the error to raise (field and adapter named)
_WEIGHT_DTYPES = ("F32", "F16", "BF16")
# base_model.model.model.layers.{i}.{self_attn|mlp}.{target}.lora_{A|B}.weight
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def projection_dims(arch: ModelArch, target: str) -> tuple[int, int]:
    """(d_in, d_out) of ``target``'s projection in a layer of ``arch`` (a dense MLP's for the
    MLP targets)."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}[target]


def _read_config(path: Path, fail: _Fail) -> dict[str, Any]:
    if not path.is_dir():
        raise fail(f"{path} is not a folder (expected a PEFT adapter: {CONFIG_FILE} + {WEIGHTS_FILE})")
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise fail(f"{path / CONFIG_FILE} is missing (expected a PEFT adapter folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise fail(f"{path / CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise fail(f"{path / CONFIG_FILE} must hold a JSON object")
    return raw


def _check_config(raw: dict[str, Any], spec: LoraSpec, fail: _Fail) -> tuple[int, float]:
    """(rank, scaling) of a LoRA config the engines serve exactly; else ``fail``."""
    peft_type = raw.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise fail(f"peft_type {peft_type!r} is not supported (LoRA adapters only)")
    for key, feature in _REFUSED_KEYS.items():
        if raw.get(key):
            raise fail(f"{feature} is not supported ({key}={raw[key]!r})")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise fail(f"trained biases are not supported (bias={bias!r}; only 'none')")
    rank, alpha = raw.get("r", 8), raw.get("lora_alpha", 8)  # peft's defaults
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise fail(f"r={rank!r} must be a positive integer")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail(f"lora_alpha={alpha!r} must be a number")
    if rank > spec.max_lora_rank:
        raise fail(f"r={rank} exceeds lora.max_lora_rank={spec.max_lora_rank}")
    targets = raw.get("target_modules")
    if isinstance(targets, (list, tuple)):  # a string is a regex: the tensors' keys decide
        for target in targets:
            _check_target(str(target), spec, fail)
    scaling = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def _check_target(target: str, spec: LoraSpec, fail: _Fail) -> None:
    if target not in LORA_TARGETS:
        raise fail(f"target module {target!r} is not supported (LoRA on "
                   f"{', '.join(LORA_TARGETS)} only)")
    if target not in spec.targets:
        raise fail(f"target module {target!r} is not in lora.target_modules "
                   f"({', '.join(spec.targets)})")


def _parse_key(key: str, arch: ModelArch, spec: LoraSpec, fail: _Fail) -> tuple[int, str, str]:
    """(layer, target, "A" | "B") of a PEFT tensor name; anything else is refused."""
    m = _KEY.fullmatch(key)
    if m is None:
        raise fail(f"tensor {key!r} is not supported (LoRA A/B weights of "
                   f"{', '.join(LORA_TARGETS)} only)")
    layer, block, target, which = int(m[1]), m[2], m[3], m[4]
    _check_target(target, spec, fail)
    if (block == "mlp") != (target in _MLP_TARGETS):
        raise fail(f"tensor {key!r}: {target} is not under {block}")
    if layer >= arch.num_layers:
        raise fail(f"tensor {key!r}: layer {layer} >= the base model's {arch.num_layers} layers")
    if arch.moe is not None and target in _MLP_TARGETS and arch.moe.sparse_layers[layer]:
        raise fail(f"tensor {key!r}: LoRA on a mixture-of-experts MLP is not supported")
    return layer, target, which


def load_peft_adapter(path: Path, name: str, arch: ModelArch, spec: LoraSpec, *,
                      field_name: str = "lora_path") -> LoraAdapter:
    """Read the PEFT adapter folder ``path`` (``adapter_config.json`` + ``adapter_model.safetensors``)
    for the base model ``arch``, served with ``spec``.

    Returns the adapter with ``A = lora_A.T`` (d_in, r) and ``B = lora_B.T`` (r, d_out) as
    float32 (F16/BF16 tensors widened) and ``scaling = lora_alpha / r`` (``use_rslora``:
    ``lora_alpha / sqrt(r)``). Raises :class:`LoraError` (``field_name``, one line naming the
    file and the feature) for what the engines do not serve: another PEFT type, DoRA, trained
    biases, ``modules_to_save``, rank/alpha patterns, targets outside :data:`LORA_TARGETS` or
    ``spec.targets``, ``r`` above ``spec.max_lora_rank``, MoE MLP targets, tensors whose shapes
    do not fit the base model, a pickled ``adapter_model.bin``.
    """
    path = Path(path)

    def fail(message: str) -> LoraError:
        return LoraError(field_name, f"adapter {name!r}: {message}")

    raw = _read_config(path, fail)
    rank, scaling = _check_config(raw, spec, fail)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.exists():
        if (path / "adapter_model.bin").exists():
            raise fail(f"{path / 'adapter_model.bin'} (a pickle) is not read: save the adapter "
                       "with safe_serialization=True (adapter_model.safetensors)")
        raise fail(f"{weights_path} is missing")
    try:
        weights = _read_weights(weights_path, rank, arch, spec, fail)
    except CheckpointError as exc:
        raise fail(str(exc)) from None
    base = raw.get("base_model_name_or_path")
    return LoraAdapter(name=name, path=path, rank=rank, scaling=scaling, weights=weights,
                       base_model=str(base) if base else None)


def _read_weights(weights_path: Path, rank: int, arch: ModelArch, spec: LoraSpec,
                  fail: _Fail) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    file = SafetensorsFile(weights_path)
    try:
        halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for key, info in sorted(file.tensors.items()):
            layer, target, which = _parse_key(key, arch, spec, fail)
            if info.dtype not in _WEIGHT_DTYPES:
                raise fail(f"tensor {key!r} has dtype {info.dtype} (expected F32, F16 or BF16)")
            d_in, d_out = projection_dims(arch, target)
            want = (rank, d_in) if which == "A" else (d_out, rank)
            if info.shape != want:
                raise fail(f"tensor {key!r} has shape {list(info.shape)}, the base model and "
                           f"r={rank} need {list(want)}")
            halves.setdefault((layer, target), {})[which] = file.read(key, np.float32)
    finally:
        file.close()
    if not halves:
        raise fail(f"{weights_path} holds no LoRA weights")
    out: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}
    for (layer, target), pair in sorted(halves.items()):
        if len(pair) != 2:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise fail(f"layer {layer} {target}: {missing} is missing")
        out[(layer, target)] = (np.ascontiguousarray(pair["A"].T), np.ascontiguousarray(pair["B"].T))
    return out
