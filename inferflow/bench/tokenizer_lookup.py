"""Which tokenizer counts the prompts' tokens when ``--tokenizer`` is not given.

vLLM's ``bench serve`` loads the tokenizer named by ``--tokenizer``, else by ``--model`` (a hub
id or a local folder). Nothing is downloaded here; the first of these that holds a
``tokenizer.json`` is used:

1. ``--tokenizer``: a ``tokenizer.json`` or a folder holding one (an error when it is missing);
2. ``--model``, when it is a local checkpoint folder;
3. the served checkpoint's folder *name*, from ``GET /version`` (the server shows no paths, on
   purpose), looked up where inferflow keeps checkpoints on this machine: ``$INFERFLOW_MODELS_DIR``,
   ``$INFERFLOW_HOME/models`` (the embedded tiny model's home), and the Hugging Face cache (where
   a snapshot's folder name is its commit hash). A server started on this machine with the
   default locations is found;
4. none: words, one word counted as one token, with a warning. A model's tokenizer usually
   splits a word into more (~1.85 tokens for the default model), so prompts come out longer
   than ``--input-len`` in the server's tokens.

The choice is written to the result as ``token_counting``: ``"tokenizer:<name>"`` or ``"words"``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx

from inferflow.bench.client import with_api_key
from inferflow.paths import inferflow_home

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class TokenCounting:
    """How prompt lengths are counted: with ``tokenizer`` (a path), or words when it is None.

    ``name`` is what the result calls the tokenizer (``tokenizer_id``): ``--tokenizer`` or
    ``--model`` as given, or the checkpoint folder's name; never a path the user did not type.
    ``warning`` says why words were used.
    """

    tokenizer: str | None
    name: str | None = None
    warning: str = ""

    @property
    def label(self) -> str:
        """The result's ``token_counting``."""
        return f"tokenizer:{self.name}" if self.tokenizer else "words"


def choose_token_counting(
    tokenizer: str | None,
    model: str | None,
    base_url: str,
    served_model: str,
    headers: dict[str, str],
) -> TokenCounting:
    """The counting for a run (see the module docstring for the order); ``model`` is
    ``--model``, ``served_model`` the name requests carry."""
    if tokenizer:
        return TokenCounting(tokenizer, tokenizer)
    if model and _has_tokenizer(Path(model).expanduser()):
        return TokenCounting(str(Path(model).expanduser()), model)
    name = served_checkpoint_name(base_url, served_model, headers)
    if name is None:
        why = "the server's GET /version does not name its checkpoint"
        return TokenCounting(None, None, _warning(served_model, why))
    for folder in checkpoint_folders(name):
        if _has_tokenizer(folder):
            return TokenCounting(str(folder), name)
    why = f"its checkpoint {name!r} is in none of this machine's model folders"
    return TokenCounting(None, None, _warning(served_model, why))


def _warning(model: str, why: str) -> str:
    return (
        f"inferflow bench: no tokenizer for {model} ({why}); counting one word as one token, "
        "so prompts are longer than --input-len in the model's tokens. Pass --tokenizer "
        "PATH (the checkpoint folder or its tokenizer.json) to count tokens"
    )


def _has_tokenizer(path: Path) -> bool:
    return (path / TOKENIZER_FILE).is_file()


def served_checkpoint_name(base_url: str, model: str, headers: dict[str, str]) -> str | None:
    """The checkpoint folder name of ``model`` (a served name or id) on ``GET /version``.

    inferflow lists every served version under ``models`` (``id`` ``name@version``, ``name``,
    ``path``); a single-model server also reports ``model``. None: not an inferflow server,
    the model is not listed, or the request failed.
    """
    try:
        response = httpx.get(f"{base_url}/version", headers=with_api_key(headers), timeout=30.0)
        response.raise_for_status()
        info = response.json()
    except (httpx.HTTPError, ValueError):
        return None
    if not isinstance(info, dict):
        return None
    listed = info.get("models")
    for entry in [*(listed if isinstance(listed, list) else []), info.get("model")]:
        if isinstance(entry, dict) and model in (entry.get("id"), entry.get("name")):
            path = entry.get("path")
            if isinstance(path, str) and path and Path(path).name == path:
                return path  # a bare folder name (never a path to follow)
    return None


def checkpoint_folders(name: str) -> list[Path]:
    """Where a checkpoint folder called ``name`` may be on this machine, in lookup order."""
    models_dir = os.environ.get("INFERFLOW_MODELS_DIR")
    roots = [Path(models_dir).expanduser()] if models_dir else []
    folders = [root / name for root in [*roots, inferflow_home() / "models"]]
    return folders + [repo / "snapshots" / name for repo in sorted(_hf_hub().glob("models--*"))]


def _hf_hub() -> Path:
    """The Hugging Face hub cache (as ``models/lookup.py`` reads it)."""
    hub = os.environ.get("HF_HUB_CACHE")
    if hub:
        return Path(hub).expanduser()
    return Path(os.environ.get("HF_HOME", "~/.cache/huggingface")).expanduser() / "hub"
