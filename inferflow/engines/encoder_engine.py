"""ONNX Runtime engine for BERT-family encoders: token ids in, pooled embeddings out.

The graph comes from ``inferflow.models.bert_graph`` and is cached on disk under
``<cache_dir>/<hash>/model.onnx`` where the hash covers the weights' digest, the graph-builder
version, the onnxruntime version and the graph-affecting settings (pooling, normalisation),
so a stale engine is never loaded. (A private cache until the shared
``inferflow.engines.engine_cache`` exists; the layout is the one DESIGN.md §4 describes.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from inferflow.models.bert import BertCheckpoint, load_bert_checkpoint
from inferflow.models.bert_graph import GRAPH_BUILDER_VERSION, OPSET, build_bert_graph


class EncoderInputError(ValueError):
    """An input cannot be encoded (empty, or a token id outside the vocabulary)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index  # position of the offending input in the batch


@dataclass(frozen=True)
class EncoderSettings:
    """Session settings; none of them changes the graph, so none is part of the cache key."""

    intra_op_threads: int = 0  # 0 = onnxruntime's default (one per physical core)
    allow_spinning: bool = False  # ORT's spin-wait after a run burns CPU on a shared machine


def default_engine_cache_dir() -> Path:
    """``$INFERFLOW_ENGINE_CACHE``, else ``$INFERFLOW_HOME/compiled_engines`` (~/.cache/inferflow)."""
    if env := os.environ.get("INFERFLOW_ENGINE_CACHE"):
        return Path(env)
    home = os.environ.get("INFERFLOW_HOME") or Path.home() / ".cache" / "inferflow"
    return Path(home) / "compiled_engines"


def make_encoder_inputs(batch: Sequence[Sequence[int]], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pad ``batch`` to its longest row: input_ids / attention_mask / token_type_ids (B, S)."""
    seq = max(len(row) for row in batch)
    input_ids = np.full((len(batch), seq), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), seq), dtype=np.int64)
    for i, row in enumerate(batch):
        input_ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(mask)}


class EncoderEngine:
    """A loaded encoder. ``encode`` is thread-safe (onnxruntime sessions allow concurrent runs)."""

    def __init__(self, session: ort.InferenceSession, checkpoint: BertCheckpoint) -> None:
        self._session = session
        self.checkpoint = checkpoint
        self.max_length = checkpoint.max_length
        self.embedding_dim = checkpoint.embedding_dim
        self.vocab_size = checkpoint.config.vocab_size
        self.pad_id = checkpoint.config.pad_token_id

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        cache_dir: str | Path | None = None,
        settings: EncoderSettings | None = None,
    ) -> EncoderEngine:
        return cls.from_checkpoint(
            load_bert_checkpoint(path), cache_dir=cache_dir, settings=settings
        )

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: BertCheckpoint,
        *,
        cache_dir: str | Path | None = None,
        settings: EncoderSettings | None = None,
    ) -> EncoderEngine:
        """Build (or reuse from the cache) the ONNX graph and open an onnxruntime session."""
        model_file = cached_encoder_model(checkpoint, Path(cache_dir or default_engine_cache_dir()))
        settings = settings or EncoderSettings()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = settings.intra_op_threads
        opts.inter_op_num_threads = 1
        spin = "1" if settings.allow_spinning else "0"
        opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
        opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
        session = ort.InferenceSession(str(model_file), opts, providers=["CPUExecutionProvider"])
        return cls(session, checkpoint)

    def truncate(self, ids: Sequence[int]) -> list[int]:
        """Keep the first ``max_length`` ids (text tokenized by our tokenizer already fits)."""
        return list(ids[: self.max_length])

    def validate(self, batch: Sequence[Sequence[int]]) -> None:
        """Raise ``EncoderInputError`` for an empty row or an id outside [0, vocab_size)."""
        for i, row in enumerate(batch):
            if len(row) == 0:
                raise EncoderInputError(f"input {i} has no tokens", i)
            lo, hi = min(row), max(row)
            if lo < 0 or hi >= self.vocab_size:
                bad = lo if lo < 0 else hi
                raise EncoderInputError(
                    f"input {i}: token id {bad} outside the vocabulary [0, {self.vocab_size})", i
                )

    def encode(self, batch: Sequence[Sequence[int]]) -> np.ndarray:
        """Embeddings (B, E) float32 for token-id rows; rows longer than max_length are truncated.

        Rows are padded to the longest one; padding does not change any row's vector beyond
        float round-off.
        """
        if not batch:
            return np.zeros((0, self.embedding_dim), dtype=np.float32)
        rows = [self.truncate(row) for row in batch]
        self.validate(rows)
        (out,) = self._session.run(["embeddings"], make_encoder_inputs(rows, self.pad_id))
        return np.asarray(out, dtype=np.float32)


def engine_key(checkpoint: BertCheckpoint) -> dict[str, str]:
    """What the cache hash covers (also written next to the model as manifest.json)."""
    return {
        "kind": "bert-encoder",
        "weights_sha256": checkpoint.weights_digest(),
        "graph_builder": GRAPH_BUILDER_VERSION,
        "opset": str(OPSET),
        "onnx": onnx.__version__,
        "onnxruntime": ort.__version__,
        "settings": json.dumps(asdict(checkpoint.pooling), sort_keys=True),
    }


def cached_encoder_model(checkpoint: BertCheckpoint, cache_dir: Path) -> Path:
    """Path of ``<cache_dir>/<hash>/model.onnx``, building and publishing it atomically if absent."""
    key = engine_key(checkpoint)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    target = cache_dir / digest
    model_file = target / "model.onnx"
    if model_file.is_file():
        return model_file
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{digest}-", dir=cache_dir))
    try:
        onnx.save_model(build_bert_graph(checkpoint), str(staging / "model.onnx"))
        (staging / "manifest.json").write_text(json.dumps(key, indent=2, sort_keys=True))
        try:
            staging.rename(target)  # atomic publish; loses the race harmlessly
        except OSError:
            if not model_file.is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return model_file
