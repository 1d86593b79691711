"""Checkpoints written by transformers' own ``save_pretrained``, as users have them.

``save_hf_checkpoint`` builds a tiny model from transformers' config class of the architecture
(so config.json is exactly what transformers 5 writes: ``rope_parameters``, ``dtype``, the
architecture's own fields), fills every parameter with seeded values (biases and norms included:
transformers initializes biases to zero, which would hide a bias the loader drops) and saves
it with ``save_pretrained``. ``config_format="legacy"`` then rewrites config.json as
transformers 4 wrote it (``rope_theta`` + ``rope_scaling``, ``torch_dtype``), the same weights.
The tokenizer is our seeded byte-level BPE (its special tokens at the ids the configs name).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from inferflow.models.tiny import train_tokenizer

# small enough to build in well under a second, large enough for GQA and several hundred tokens
BASE: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
    "bos_token_id": 0, "eos_token_id": 4, "pad_token_id": 1, "tie_word_embeddings": False,
}


def config_class(architecture: str) -> Any:
    """transformers' config class of ``architecture`` (Gemma 3's text-only one for Gemma 3)."""
    import transformers

    text = "Text" if architecture == "Gemma3ForCausalLM" else ""
    return getattr(transformers, architecture.replace("ForCausalLM", f"{text}Config"))


def save_hf_checkpoint(path: Path, architecture: str = "LlamaForCausalLM", *, seed: int = 0,
                       config_format: str = "v5", **config: Any) -> Path:
    """A seeded tiny ``architecture`` checkpoint in ``path``, saved by transformers; ``config``
    overrides the config class's arguments (e.g. ``hidden_act="gelu"``,
    ``rope_parameters={...}``)."""
    import torch
    import transformers

    if (path / "config.json").exists():
        return path
    hf_config = config_class(architecture)(**{**BASE, **config})
    model = getattr(transformers, architecture)(hf_config).to(torch.float32)
    _fill(model, seed)
    model.save_pretrained(path)
    train_tokenizer(hf_config.vocab_size, path)
    if config_format == "legacy":
        to_legacy(path / "config.json")
    return path


def _fill(model: Any, seed: int) -> None:
    """Every parameter seeded, scaled so logits are peaked (greedy decoding is then robust to
    the round-off of different kernels)."""
    import torch

    rng = np.random.default_rng(seed)
    gains = {"q_proj": 2.0, "k_proj": 2.0, "o_proj": 0.5, "down_proj": 0.5, "lm_head": 4.0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = tuple(p.shape)
            if name.endswith("norm.weight"):
                value = 1 + 0.1 * rng.standard_normal(shape)
            elif name.endswith(".bias"):
                value = 0.1 * rng.standard_normal(shape)
            elif "embed_tokens" in name:
                value = rng.standard_normal(shape)
            else:
                gain = next((g for key, g in gains.items() if key in name), 1.0)
                value = rng.standard_normal(shape) * gain / np.sqrt(shape[-1])
            p.copy_(torch.from_numpy(value.astype(np.float32)))


def to_legacy(config_path: Path) -> None:
    """Rewrite a transformers-5 config.json in transformers 4's spelling."""
    cfg = json.loads(config_path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    if "full_attention" in rope:  # Gemma 3: the local layers' base was rope_local_base_freq
        cfg["rope_local_base_freq"] = rope.pop("sliding_attention")["rope_theta"]
        rope = dict(rope["full_attention"])
    cfg["rope_theta"] = rope.pop("rope_theta")
    partial = rope.pop("partial_rotary_factor", None)
    if partial is not None:  # Phi: a top-level key in transformers 4
        cfg["partial_rotary_factor"] = partial
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    cfg["torch_dtype"] = cfg.pop("dtype")
    cfg.pop("layer_types", None)  # Qwen2: written by transformers 5 only
    config_path.write_text(json.dumps(cfg, indent=2))


def long_prompt(tokenizer: Any, n_tokens: int) -> list[int]:
    """Token ids of about ``n_tokens`` of English text (the built-in corpus), BOS first."""
    from inferflow.models.tiny_corpus import CORPUS

    ids = tokenizer.encode(CORPUS)
    while len(ids) < n_tokens:
        ids += tokenizer.encode(CORPUS, add_special_tokens=False)
    return ids[:n_tokens]
