"""Shared cases and factories for the embedding tests (imported by conftest and the tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from inferflow.embeddings.encoder_runner import EncoderSettings

SETTINGS = EncoderSettings(intra_op_threads=1)  # 2 shared cores: stay polite

# short, long (> 256 tokens: truncated), unicode, empty-ish, punctuation, numbers
SENTENCES = [
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on stage while the crowd sings along.",
    " ".join(f"word{i} filler text" for i in range(200)),
    "Ünïcödé façade — naïve café, 日本語のテキスト, 中文句子, emoji 🙂🚀",
    "",
    "   ",
    "\n\t",
    "!!! ??? ...",
    "3.14159 2718 1e10 0x1F",
    "Short.",
    "Embeddings map sentences to vectors so that similar meanings are close together.",
]


def cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def write_tiny_bert(
    path: Path,
    tokenizer_from: Path,
    *,
    pooling: tuple[str, ...] = ("mean",),
    normalize: bool = False,
    hidden_act: str = "gelu",
    max_seq_length: int | None = 48,
    dtype: str = "float32",
    seed: int = 0,
) -> Path:
    """A 2-layer BERT (hidden 32) with seeded non-trivial weights, in sentence-transformers layout."""
    import torch
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_act=hidden_act,
    )
    torch.manual_seed(seed)
    model = BertModel(cfg, add_pooling_layer=False)
    with torch.no_grad():  # default init (std 0.02, LN = 1/0) is too bland to catch mistakes
        for name, p in model.named_parameters():
            base = 1.0 if name.endswith("LayerNorm.weight") else 0.0
            p.copy_(base + 0.3 * torch.randn_like(p))
    model.to(getattr(torch, dtype)).save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(tokenizer_from / f, path / f)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, "pooling_mode": list(pooling)})
    )
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length, "do_lower_case": False})
        )
    return path
