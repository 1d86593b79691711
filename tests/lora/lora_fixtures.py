"""Shared by the LoRA unit tests: a small base-model architecture and adapters written with numpy."""

from __future__ import annotations

import json
from pathlib import Path

from inferflow.models.config import ModelArch, parse_model_config
from inferflow.models.tiny import TinySpec, config_json

SMALL = TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 vocab_size=64)


def small_arch(folder: Path) -> ModelArch:
    """The architecture of ``SMALL`` (config.json written to ``folder``, no weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json(SMALL, 8, "float32")))
    return parse_model_config(folder / "config.json")
