"""Model architecture read from a checkpoint's ``config.json`` (never duplicated in YAML).

Both formats transformers writes are read: today's (transformers >= 5: ``rope_parameters``,
``dtype``) and the legacy one (``rope_theta`` + ``rope_scaling``, ``torch_dtype``). Every field
that changes the math is either served as transformers computes it or refused in one line
naming the field and value (``config_fields.py`` lists them all; ``rope.py`` the rotary ones);
a field the file leaves out takes the default of transformers' class for the architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from inferflow.json_types import JSONObject
from inferflow.models.config_fields import ACTIVATIONS
from inferflow.models.errors import CheckpointError
from inferflow.models.families import FAMILIES, SUPPORTED_ARCHITECTURES
from inferflow.models.family import Block, Family, MoE, switch
from inferflow.models.rope import RotarySettings, read_rotary

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelArch", "parse_model_config"]


@dataclass(frozen=True)
class ModelArch:
    """The decoder-only architecture parameters inferflow's graph builders need."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RotarySettings
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2; Llama's attention_bias)
    torch_dtype: str  # the checkpoint's storage type (config.json's dtype or torch_dtype)
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # per layer: its attention window (a key at distance >= window is not seen; None: the
    # whole context); empty means no layer has one
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # what the MLP's gate goes through: silu | gelu | gelu_tanh | relu
    o_proj_bias: bool = False  # the attention's output projection has a bias (Llama)
    mlp_bias: bool = False  # gate, up and down projections have biases (Llama's mlp_bias)
    block: Block = field(default_factory=Block)  # where a layer departs from Llama's
    local_rope: RotarySettings | None = None  # windowed layers' rotary where it differs (Gemma 3)
    moe: MoE | None = None  # the MLP of sparse layers is a mixture of experts
    raw: JSONObject = field(default_factory=dict, compare=False, repr=False)

    @property
    def rope_theta(self) -> float:
        return self.rope.theta

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that rotate (the first ones; all but for partial rotary)."""
        return self.rope.rotary_dim(self.head_dim)

    @property
    def sliding_window(self) -> int | None:
        """The largest window of a layer that has one (None: every layer sees everything)."""
        return max((w for w in self.layer_windows if w is not None), default=None)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_rope(self, layer: int) -> RotarySettings:
        """Layer ``layer``'s rotary: the local one on windowed layers where the family has it."""
        return self.local_rope if self.local_rope is not None and self.window(layer) else self.rope

    def is_sparse(self, layer: int) -> bool:
        """Layer ``layer``'s MLP is the mixture of experts."""
        return self.moe is not None and self.moe.sparse_layers[layer]

    def describe(self) -> JSONObject:
        """The architecture as ``/version`` and ``task=check`` show it: the shape, and where it
        departs from the Llama block (only what is set)."""
        out: JSONObject = {
            "architecture": self.architecture, "num_layers": self.num_layers,
            "hidden_size": self.hidden_size, "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rope": self.rope.describe(),
        }
        if self.rotary_dim != self.head_dim:
            out["rotary_dim"] = self.rotary_dim
        if self.layer_windows:
            out["layer_windows"] = list(self.layer_windows)
        if self.local_rope is not None:
            out["local_rope"] = self.local_rope.describe()
        plain = Block()
        block = {f.name: getattr(self.block, f.name) for f in fields(Block)
                 if getattr(self.block, f.name) != getattr(plain, f.name)}
        if block:
            out["block"] = block
        if self.moe is not None:
            m = self.moe
            out["moe"] = {"num_experts": m.num_experts, "top_k": m.top_k,
                          "norm_topk_prob": m.norm_topk_prob,
                          "sparse_layers": sum(m.sparse_layers),
                          "shared_expert": m.shared_expert}
        return out

    def summary(self) -> str:
        """One line: ``Gemma3ForCausalLM (6 layers, windows 5 x 512 + 1 global, ...)``."""
        parts = [f"{self.num_layers} layers", f"rope {self.rope.describe()}"]
        if self.layer_windows:
            windowed = sum(w is not None for w in self.layer_windows)
            parts.append(f"window {self.sliding_window} on {windowed}/{self.num_layers} layers")
        if self.moe is not None:
            parts.append(f"{self.moe.num_experts} experts, top {self.moe.top_k}")
        return f"{self.architecture} ({', '.join(parts)})"

    @property
    def num_parameters(self) -> int:
        return self._parameters(active=False)

    @property
    def active_parameters(self) -> int:
        """Parameters a token computes with: a sparse layer counts its router, its top_k
        experts and its shared expert (all of them for a dense model)."""
        return self._parameters(active=True)

    def _parameters(self, active: bool) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        biases = (q + 2 * kv) * self.attention_bias + h * self.o_proj_bias + (2 * i + h) * self.mlp_bias
        attention = h * (q + 2 * kv) + q * h + 2 * h + biases
        mlp = 0
        for layer in range(self.num_layers):
            if self.is_sparse(layer):
                assert self.moe is not None
                m = self.moe
                experts = m.top_k if active else m.num_experts
                mlp += m.num_experts * h + experts * 3 * h * m.intermediate_size  # router + experts
                mlp += (3 * h * m.shared_intermediate_size + h) if m.shared_expert else 0
            else:
                mlp += 3 * h * i
        head = 0 if self.tie_word_embeddings else v * h
        return v * h + self.num_layers * attention + mlp + h + head

    def check_context(self, path: Path, served: int, knob: str) -> None:
        """Refuse a served context this engine would compute wrongly (``served``/``knob``: the
        served context and the setting that sets it, for the messages)."""
        limit = self.rope.max_context
        if limit is not None and limit < served:
            raise CheckpointError(
                path, f"rope type {self.rope.rope_type!r} is served up to its "
                f"original_max_position_embeddings={limit} (past it transformers switches every "
                f"position to long_factor); serve it with {knob}={limit} (or less)")


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _read(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(path, "config.json is missing (expected a Hugging Face checkpoint folder)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, "must hold a JSON object")
    return raw


def _architecture(path: Path, raw: dict[str, Any]) -> tuple[str, Family]:
    archs = raw.get("architectures") or []
    by_type = {f.model_type: name for name, f in FAMILIES.items()}
    name = archs[0] if archs else by_type.get(str(raw.get("model_type")), raw.get("model_type", "?"))
    if name not in FAMILIES:
        raise CheckpointError(
            path, f"architecture {name!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    return name, FAMILIES[name]


def _refuse_unsupported(path: Path, raw: dict[str, Any], arch: Family) -> str:
    """The executors' activation for ``hidden_act``; refuses what no executor computes."""
    quant = raw.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(
            path, f"quantization_config (quant_method={method!r}) is not supported: serve the "
            "unquantized checkpoint; inferflow quantizes when it builds the engine "
            "(executor.precision=int8 or int4)")
    key = arch.activation_key
    act = arch.get(raw, key)
    if act not in ACTIVATIONS:
        raise CheckpointError(path, f"{key}={act!r} is not supported (supported: "
                              f"{', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[act]


def parse_model_config(path: Path) -> ModelArch:
    """Read ``path`` (a config.json) into a :class:`ModelArch`; unsupported models fail clearly."""
    raw = _read(path)
    name, arch = _architecture(path, raw)
    act = _refuse_unsupported(path, raw, arch)

    def get(key: str) -> Any:  # the file's value (null included), else the class default
        return arch.get(raw, key)

    try:
        num_heads, hidden = int(raw["num_attention_heads"]), int(raw["hidden_size"])
        num_layers = int(raw["num_hidden_layers"])
        max_positions = int(get("max_position_embeddings"))
        windows = arch.windows(raw, arch.defaults, num_layers) if arch.windows else ()
        rope = read_rotary(path, raw, max_positions)
        local_rope = rope
        if arch.per_layer_type_rope and any(w is not None for w in windows):
            local_rope = read_rotary(path, raw, max_positions, "sliding_attention")
        cfg = ModelArch(
            architecture=name,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(get("head_dim") or hidden // num_heads),
            max_position_embeddings=max_positions,
            rms_norm_eps=float(get("rms_norm_eps")),
            rope=rope,
            tie_word_embeddings=bool(get("tie_word_embeddings")),
            attention_bias=switch(raw, arch.defaults, arch.qkv_bias),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            bos_token_id=get("bos_token_id"),
            eos_token_ids=_eos_ids(get("eos_token_id")),
            layer_windows=windows if any(w is not None for w in windows) else (),
            hidden_act=act,
            o_proj_bias=switch(raw, arch.defaults, arch.o_bias),
            mlp_bias=switch(raw, arch.defaults, arch.mlp_bias),
            block=arch.block(raw, arch.defaults) if arch.block else Block(),
            local_rope=local_rope if local_rope != rope else None,
            moe=arch.moe(raw, arch.defaults, num_layers) if arch.moe else None,
            raw=raw,
        )
    except CheckpointError:
        raise
    except KeyError as exc:
        raise CheckpointError(path, f"missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:  # a value of the wrong type, or layer_types
        raise CheckpointError(path, str(exc)) from None
    if cfg.num_heads % cfg.num_kv_heads:
        raise CheckpointError(path, "num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.rotary_dim % 2:
        raise CheckpointError(path, "the rotary part of a head (head_dim x partial_rotary_factor) "
                              "must be even")
    return cfg
