"""How a model family differs from the Llama decoder block, said once and read from config.json.

A :class:`Family` (one per transformers ``*ForCausalLM`` class; the modules of ``families/``
define them) turns a config.json into the parts of :class:`~inferflow.models.config.ModelArch`
that are not Llama's: a :class:`Block` (norms, scales, soft-capping, rotary width, weight layout),
the attention window of every layer, the rotary of windowed layers where it differs, and a
:class:`MoE` where the MLP is a mixture of experts. The ONNX graph builder, the torch model and
the weight loader read only those resolved values, never the family: a new family is a new
module in ``families/`` that maps its config keys onto them (or refuses what they cannot say).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Raw = Mapping[str, Any]  # config.json as parsed


@dataclass(frozen=True)
class Block:
    """One decoder layer, as it departs from Llama's (the defaults are Llama's)."""

    norm_offset: float = 0.0  # RMSNorm scales by (offset + w): Gemma's (1 + w)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3, Gemma 3)
    # Gemma 2/3: the attention output and the MLP output are normed before their residual adds
    # (post_attention_layernorm, post_feedforward_layernorm); the MLP's input norm is
    # pre_feedforward_layernorm instead of post_attention_layernorm
    sandwich_norms: bool = False
    embed_scale: float = 1.0  # the embedding is multiplied by this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # softmax scale of q·k; None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    fused_qkv: bool = False  # weights: one self_attn.qkv_proj (rows q | k | v) (Phi-3)
    fused_gate_up: bool = False  # weights: one mlp.gate_up_proj (rows gate | up) (Phi-3)


@dataclass(frozen=True)
class MoE:
    """A mixture-of-experts MLP: a linear router picks ``top_k`` of ``num_experts`` SwiGLU
    experts per token (softmax over all experts, then the top k; renormalised over those k when
    ``norm_topk_prob``), and a shared expert, gated by sigmoid(shared_gate · x), is added where
    ``shared_intermediate_size`` > 0 (Qwen2-MoE). Layers not in ``sparse_layers`` keep a dense MLP
    of ``intermediate_size``."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    norm_topk_prob: bool
    sparse_layers: tuple[bool, ...]  # per layer: the MLP is the mixture
    shared_intermediate_size: int = 0
    # weight names below ``model.layers.{i}.``: the router, and expert e's gate/up/down
    router: str = "mlp.gate.weight"
    expert: str = "mlp.experts.{e}."
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")

    @property
    def shared_expert(self) -> bool:
        return self.shared_intermediate_size > 0


def switch(raw: Raw, defaults: Mapping[str, Any], rule: str | bool) -> bool:
    """A bias rule read from config.json: a fixed value, or the key it names (class default)."""
    if isinstance(rule, bool):
        return rule
    return bool(raw.get(rule, defaults.get(rule, False)))


@dataclass(frozen=True)
class Family:
    """One architecture transformers serves (its ``*ForCausalLM`` class) and what it reads.

    ``defaults``: transformers' class defaults of the keys a file may leave out.
    ``reads``: the config keys honoured beyond the ones every family reads
    (``config_fields.COMMON_READ``); ``ignores``: the family's keys that have no effect at
    inference. ``windows``: per layer, the attention window (None: the whole context).
    ``block``/``moe``/``local_rope_key``: the rest of the description (see the module docstring).
    """

    architecture: str
    model_type: str
    defaults: Mapping[str, Any] = field(default_factory=dict)
    reads: frozenset[str] = frozenset()
    ignores: frozenset[str] = frozenset()
    qkv_bias: str | bool = False  # a config key naming the switch, or fixed
    o_bias: str | bool = False
    mlp_bias: str | bool = False
    windows: Callable[[Raw, Mapping[str, Any], int], tuple[int | None, ...]] | None = None
    block: Callable[[Raw, Mapping[str, Any]], Block] | None = None
    moe: Callable[[Raw, Mapping[str, Any], int], MoE | None] | None = None
    activation_key: str = "hidden_act"  # Gemma: hidden_activation
    # rope_parameters nested per layer type (Gemma 3): windowed layers rotate with their own
    per_layer_type_rope: bool = False

    def get(self, raw: Raw, key: str) -> Any:
        """The file's value (null included), else the class default."""
        return raw[key] if key in raw else self.defaults.get(key)


# --- window rules shared by families ----------------------------------------------------------

LAYER_TYPES = ("full_attention", "sliding_attention")


def check_layer_types(types: list[str]) -> None:
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types {unknown[0]!r} is not supported (supported: "
                         f"{', '.join(LAYER_TYPES)})")


def windows_from_types(types: list[str], window: int | None) -> tuple[int | None, ...]:
    check_layer_types(types)
    return tuple(window if t == "sliding_attention" else None for t in types)


def every_layer(raw: Raw, defaults: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Mistral, Mixtral, Phi-3: ``sliding_window`` (null: none) on every layer."""
    window = raw.get("sliding_window", defaults.get("sliding_window"))
    return (int(window) if window else None,) * num_layers


def qwen_windows(raw: Raw, defaults: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Qwen2/Qwen3 and their MoE: a window only with ``use_sliding_window``, on the layers
    ``layer_types`` marks (they are the truth when present), else from ``max_window_layers`` on."""
    window = raw.get("sliding_window", defaults.get("sliding_window"))
    if not raw.get("use_sliding_window", defaults.get("use_sliding_window")) or not window:
        check_layer_types(list(raw.get("layer_types") or []))
        return (None,) * num_layers
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers", defaults.get("max_window_layers", 0)))
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return windows_from_types(list(types), int(window))


def no_windows(raw: Raw, defaults: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
    return (None,) * num_layers
