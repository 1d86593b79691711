"""A checkpoint with an 8-token vocabulary (word-level tokenizer, seeded random weights), for
statistical tests of sampling: a distribution over 8 tokens is measurable in a few thousand
samples, and n-gram drafts over it are accepted often enough to matter."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inferflow.models.tiny import TinySpec, _random_weights, _write_weights, config_json

WORDS = ["<|begin_of_text|>", "<unk>", "a", "b", "<|eot_id|>", "c", "d", "e"]  # eos id 4


def make_tiny_vocab_checkpoint(path: Path, seed: int = 3, lm_head_gain: float = 1.0) -> Path:
    """8-token model. With ``lm_head_gain`` 1 each position's distribution at temperature 1 has
    several likely tokens (top ~0.3) and n-gram drafts are accepted ~28% of the time."""
    if (path / "tokenizer.json").exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    spec = TinySpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, vocab_size=len(WORDS), max_position_embeddings=256,
                    llama3_rope_scaling=False)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    # BOS comes from the post-processor (transformers 5 ignores add_bos_token beside it)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{WORDS[0]} $A", pair=f"{WORDS[0]} $A {WORDS[0]} $B",
        special_tokens=[(WORDS[0], 0)],
    )
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": WORDS[0], "eos_token": WORDS[4], "add_bos_token": True}))
    weights = _random_weights(spec, spec.hidden_size // spec.num_heads, seed)
    weights["lm_head.weight"] = (weights["lm_head.weight"] * lm_head_gain).astype(np.float32)
    (path / "config.json").write_text(json.dumps(config_json(spec, 16, "float32"), indent=2))
    _write_weights(weights, path, "float32", 1)
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 4}))
    return path
