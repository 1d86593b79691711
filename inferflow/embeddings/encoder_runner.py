"""ONNX Runtime engine for BERT-family encoders: token ids in, pooled embeddings out.

The graph comes from ``inferflow.models.bert_graph`` and lives in the shared compiled-engine
cache (``inferflow.runtimes.engine_cache``: ``<engine_dir>/<key>/model.onnx``); the key covers
the weights' digest, the graph-builder version and source, the onnx/onnxruntime versions and the
graph-affecting settings (pooling, normalisation), so a stale engine is never loaded.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from inferflow.models import bert_graph
from inferflow.models.bert import BertCheckpoint, load_bert_checkpoint
from inferflow.models.bert_graph import GRAPH_BUILDER_VERSION, OPSET, build_bert_graph
from inferflow.runtimes.config import default_engine_dir
from inferflow.runtimes.engine_cache import CacheEntry, get_or_build


class EncoderInputError(ValueError):
    """An input cannot be encoded (empty, or a token id outside the vocabulary)."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index  # position of the offending input in the batch


@dataclass(frozen=True)
class EncoderSettings:
    """Session settings; none of them changes the graph, so none is part of the cache key.

    ``cache_dir`` of ``from_path``/``from_checkpoint`` defaults to ``default_engine_dir()``
    ($INFERFLOW_ENGINE_DIR, else $INFERFLOW_HOME/compiled_engines, ~/.cache/inferflow).
    """

    intra_op_threads: int = 0  # 0 = onnxruntime's default (one per physical core)
    allow_spinning: bool = False  # ORT's spin-wait after a run burns CPU on a shared machine


def make_encoder_inputs(batch: Sequence[Sequence[int]], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Right-pad ``batch`` to its longest row: input_ids / attention_mask / token_type_ids (B, S)."""
    seq = max(len(row) for row in batch)
    input_ids = np.full((len(batch), seq), pad_id, dtype=np.int64)
    mask = np.zeros((len(batch), seq), dtype=np.int64)
    for i, row in enumerate(batch):
        input_ids[i, : len(row)] = row
        mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "token_type_ids": np.zeros_like(mask)}


class EncoderRunner:
    """A loaded encoder. ``encode`` is thread-safe (onnxruntime sessions allow concurrent runs)."""

    def __init__(
        self,
        session: ort.InferenceSession,
        checkpoint: BertCheckpoint,
        cache_entry: CacheEntry | None = None,
    ) -> None:
        self._session = session
        self.cache_entry = cache_entry  # where the compiled graph lives (None: built in memory)
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
    ) -> EncoderRunner:
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
    ) -> EncoderRunner:
        """Build (or reuse from the cache) the ONNX graph and open an onnxruntime session."""
        entry = cached_encoder_model(
            checkpoint, Path(cache_dir) if cache_dir else default_engine_dir()
        )
        settings = settings or EncoderSettings()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = settings.intra_op_threads
        opts.inter_op_num_threads = 1
        spin = "1" if settings.allow_spinning else "0"
        opts.add_session_config_entry("session.intra_op.allow_spinning", spin)
        opts.add_session_config_entry("session.inter_op.allow_spinning", spin)
        opts.log_severity_level = 3
        session = ort.InferenceSession(
            str(entry.model_path), opts, providers=["CPUExecutionProvider"]
        )
        return cls(session, checkpoint, entry)

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


def engine_fields(checkpoint: BertCheckpoint) -> dict[str, str]:
    """What the compiled-engine cache key covers (also recorded in the entry's manifest)."""
    return {
        "kind": "bert-encoder",
        "weights_digest": checkpoint.weights_digest(),
        "builder_version": GRAPH_BUILDER_VERSION,
        # edits to the builder invalidate the cache even when nobody bumps the version
        "builder_source": hashlib.sha256(inspect.getsource(bert_graph).encode()).hexdigest(),
        "opset": str(OPSET),
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "pooling": ",".join(checkpoint.pooling.modes),
        "normalize": str(checkpoint.pooling.normalize),
    }


def cached_encoder_model(checkpoint: BertCheckpoint, cache_dir: Path) -> CacheEntry:
    """The shared compiled-engine cache entry for ``checkpoint`` (built on first use)."""
    return get_or_build(cache_dir, engine_fields(checkpoint), lambda _folder: build_bert_graph(checkpoint))
