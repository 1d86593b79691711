"""Phi-3 and Phi-4-mini: the Llama block with q/k/v in one ``qkv_proj`` and gate/up in one
``gate_up_proj`` (split as they are read), partial rotary where ``partial_rotary_factor`` < 1
(Phi-4-mini: 0.75) and ``sliding_window`` on every layer. ``longrope`` scaling is refused by
``rope.py`` in one line."""

from __future__ import annotations

from inferflow.models.family import Block, Family, every_layer

PHI3 = Family(
    "Phi3ForCausalLM", "phi3",
    {"hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
     "num_key_value_heads": None, "max_position_embeddings": 4096, "bos_token_id": 1,
     "eos_token_id": 32000, "sliding_window": None, "original_max_position_embeddings": 4096},
    reads=frozenset({"sliding_window", "original_max_position_embeddings"}),
    ignores=frozenset({"embd_pdrop", "resid_pdrop"}),  # dropout is off at inference
    windows=every_layer,
    block=lambda raw, defaults: Block(fused_qkv=True, fused_gate_up=True))

FAMILIES = (PHI3,)
