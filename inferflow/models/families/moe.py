"""Mixtures of experts: Mixtral (top-k of ``num_local_experts``, always renormalised, a window on
every layer), Qwen3-MoE (Qwen3's q/k norms; ``norm_topk_prob``; ``mlp_only_layers`` and
``decoder_sparse_step`` say which layers are sparse) and Qwen2-MoE (q/k/v biases and a shared
expert behind a sigmoid gate). The expert count is read in both spellings: hub files say
``num_experts`` where transformers 5 writes ``num_local_experts`` (Qwen-MoE)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from inferflow.models.families.llama import COMMON
from inferflow.models.family import Block, Family, MoE, Raw, every_layer, qwen_windows


def _experts(raw: Raw, defaults: Mapping[str, Any]) -> int:
    for key in ("num_local_experts", "num_experts"):
        if raw.get(key) is not None:
            return int(raw[key])
    return int(defaults.get("num_local_experts") or defaults["num_experts"])


def _mixtral(raw: Raw, defaults: Mapping[str, Any], num_layers: int) -> MoE:
    return MoE(num_experts=_experts(raw, defaults),
               top_k=int(raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])),
               intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
               sparse_layers=(True,) * num_layers, router="block_sparse_moe.gate.weight",
               expert="block_sparse_moe.experts.{e}.", expert_proj=("w1", "w3", "w2"))


def _qwen(raw: Raw, defaults: Mapping[str, Any], num_layers: int) -> MoE:
    def get(key: str) -> Any:
        return raw[key] if key in raw else defaults.get(key)

    experts, step = _experts(raw, defaults), int(get("decoder_sparse_step") or 1)
    dense = set(get("mlp_only_layers") or ())
    return MoE(num_experts=experts, top_k=int(get("num_experts_per_tok")),
               intermediate_size=int(get("moe_intermediate_size")),
               norm_topk_prob=bool(get("norm_topk_prob")),
               sparse_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0
                                   for i in range(num_layers)),
               shared_intermediate_size=int(get("shared_expert_intermediate_size") or 0))


_IGNORES = frozenset({"output_router_logits", "router_aux_loss_coef",  # training only
                      "router_jitter_noise"})
_QWEN_READS = frozenset({"num_experts", "num_local_experts", "num_experts_per_tok",
                         "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                         "mlp_only_layers", "sliding_window", "use_sliding_window"})

MIXTRAL = Family(
    "MixtralForCausalLM", "mixtral",
    {**COMMON, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "bos_token_id": 1,
     "eos_token_id": 2, "num_key_value_heads": 8, "sliding_window": None,
     "num_local_experts": 8, "num_experts_per_tok": 2},
    reads=frozenset({"num_local_experts", "num_experts", "num_experts_per_tok",
                     "sliding_window"}),
    ignores=_IGNORES, windows=every_layer, moe=_mixtral)


def _qwen3_moe_windows(raw: Raw, defaults: Mapping[str, Any],
                       num_layers: int) -> tuple[int | None, ...]:
    """Qwen3-MoE has no layer types: with ``use_sliding_window`` every layer has the window."""
    if not raw.get("use_sliding_window", defaults.get("use_sliding_window")):
        return (None,) * num_layers
    return every_layer(raw, defaults, num_layers)


QWEN3_MOE = Family(
    "Qwen3MoeForCausalLM", "qwen3_moe",
    {**COMMON, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
     "num_key_value_heads": 4, "use_sliding_window": False, "sliding_window": 4096,
     "attention_bias": False, "num_experts": 128, "num_experts_per_tok": 8,
     "norm_topk_prob": False, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
     "mlp_only_layers": None},
    reads=_QWEN_READS | {"attention_bias"}, ignores=_IGNORES,
    qkv_bias="attention_bias", o_bias="attention_bias", windows=_qwen3_moe_windows,
    block=lambda raw, defaults: Block(qk_norm=True), moe=_qwen)

QWEN2_MOE = Family(
    "Qwen2MoeForCausalLM", "qwen2_moe",
    {**COMMON, "max_position_embeddings": 32768, "bos_token_id": None, "eos_token_id": None,
     "num_key_value_heads": 16, "use_sliding_window": False, "sliding_window": 4096,
     "max_window_layers": 28, "num_experts": 60, "num_experts_per_tok": 4,
     "norm_topk_prob": False, "moe_intermediate_size": 1408,
     "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
     "mlp_only_layers": None, "qkv_bias": True},
    reads=_QWEN_READS | {"shared_expert_intermediate_size", "qkv_bias", "max_window_layers",
                         "layer_types"},
    ignores=_IGNORES, qkv_bias="qkv_bias", windows=qwen_windows, moe=_qwen)

FAMILIES = (MIXTRAL, QWEN3_MOE, QWEN2_MOE)
