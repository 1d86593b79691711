"""Where a model preset's checkpoint is found: ``model.path``, a built-in model, the models
folder (``model.models_dir`` / ``$INFERFLOW_MODELS_DIR``, default ``$INFERFLOW_HOME/models``),
then the Hugging Face cache (read-only). Nothing is downloaded."""

from __future__ import annotations

import os
from pathlib import Path

from inferflow.config.base import ConfigError
from inferflow.config.schema import ModelConfig
from inferflow.paths import inferflow_home

BUILTIN_MODELS = {
    "tiny_llama": "inferflow.models.tiny.tiny_llama_path",
    "minilm": "inferflow.models.bert.minilm_path",
}
BUILTIN_NAMES = {"tiny_llama": "tiny-llama", "minilm": "all-minilm-l6-v2"}  # default served ids


def _hf_snapshot(repo: str) -> Path | None:
    """The Hugging Face cache's snapshot of ``repo`` (refs/main, else the newest), if any."""
    hub = (
        os.environ.get("HF_HUB_CACHE")
        or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub"
    )
    root = Path(hub).expanduser() / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / "main"
    if ref.is_file():
        return root / "snapshots" / ref.read_text().strip()
    snaps = sorted((root / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
    return snaps[-1] if snaps else None


def resolve_model(model: ModelConfig) -> tuple[Path, str]:
    """(checkpoint folder, served name) for ``model``; :class:`ConfigError` when not found."""
    if model.path:
        path = Path(os.path.expandvars(model.path)).expanduser().absolute()
        if not (path / "config.json").is_file():
            problem = "has no config.json" if path.is_dir() else "does not exist"
            raise ConfigError(
                f"model.path={path} {problem}; point model.path at a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json)",
                "model.path",
            )
        return path, model.name or path.name
    if model.builtin:
        if model.builtin not in BUILTIN_MODELS:
            raise ConfigError(
                f"model.builtin: unknown {model.builtin!r}; allowed values: {', '.join(BUILTIN_MODELS)}",
                "model.builtin",
            )
        from hydra.utils import get_method

        from inferflow.models.errors import CheckpointError

        try:
            path = Path(get_method(BUILTIN_MODELS[model.builtin])())
        except CheckpointError as exc:  # e.g. the package that ships it is not installed
            raise ConfigError(f"model.builtin={model.builtin}: {exc}", "model.builtin") from None
        return path, model.name or BUILTIN_NAMES[model.builtin]
    if not model.dirname and not model.hf_repo:
        raise ConfigError(
            "model.path: a checkpoint folder is required, e.g. +model=local model.path=/models/Llama-3.2-1B-Instruct",
            "model.path",
        )
    looked: list[str] = []
    if model.dirname:
        base = (
            Path(model.models_dir).expanduser() if model.models_dir else inferflow_home() / "models"
        )
        looked.append(str(base / model.dirname))
        if (base / model.dirname / "config.json").is_file():
            return (base / model.dirname).absolute(), model.name or model.dirname
    if model.hf_repo:
        looked.append(f"the Hugging Face cache ({model.hf_repo})")
        snap = _hf_snapshot(model.hf_repo)
        if snap is not None and (snap / "config.json").is_file():
            return snap.absolute(), model.name or model.hf_repo.split("/")[-1]
    folder = model.dirname or "the checkpoint folder"
    raise ConfigError(
        f"checkpoint of model '{model.name}' not found (looked in {' and '.join(looked)}); "
        f"put the Hugging Face checkpoint files (config.json, *.safetensors, tokenizer.json) in "
        f"{looked[0]}, set INFERFLOW_MODELS_DIR to the folder containing {folder}, "
        "or pass model.path=/path/to/checkpoint",
        "model.path",
    )
