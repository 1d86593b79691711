"""Embeddings: an offline ``Embedder`` and the ``EmbeddingService`` the server calls.

Offline::

    from inferflow.embeddings import Embedder
    vectors = Embedder(minilm_path()).embed(["a sentence", "another"])  # (2, 384) float32

Serving (``POST /v1/embeddings``)::

    service = EmbeddingService.from_path(path, batching=DynamicBatching(max_num_seqs=32, max_delay_ms=2))
    result = service.embed(["a sentence"])            # blocking, thread-safe
    result = await service.embed_async(["a sentence"])  # asyncio; cancelling drops queued inputs
    result.vectors (N, E) float32, result.prompt_tokens

Every input of a request is one item of the dynamic batcher, so inputs from concurrent requests
share engine calls. Errors: ``EmbeddingInputError`` (HTTP 400, names the field),
``QueueFull`` (429), ``BatcherClosed`` (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferflow.embeddings.dynamic_batcher import BatcherStats, DynamicBatcher
from inferflow.embeddings.encoder_runner import EncoderRunner, EncoderSettings
from inferflow.models.bert import BertTokenizer, load_bert_checkpoint, minilm_path
from inferflow.stages.batching import DynamicBatching

EmbeddingInput = str | Sequence[int]
MAX_INPUTS_PER_REQUEST = 2048  # OpenAI's limit for one embeddings request


class EmbeddingInputError(ValueError):
    """A request input is invalid (HTTP 400); ``field`` is an OpenAI-style path like ``input[3]``."""

    def __init__(self, message: str, field: str = "input") -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class EmbeddingResult:
    """Vectors for one request, row i for input i, plus usage and timing."""

    vectors: np.ndarray  # (N, E) float32
    prompt_tokens: int  # tokens the model saw (after truncation, incl. [CLS]/[SEP]), summed
    queue_time_s: float  # longest wait of an input between submit and its batch starting
    compute_time_s: float  # longest engine call that served one of the inputs


@dataclass
class _Item:
    """One input inside the batcher; the batch function stamps the timings."""

    ids: list[int]
    submitted_at: float  # time.monotonic()
    started_at: float = 0.0
    compute_s: float = 0.0


class Embedder:
    """Offline embeddings: ``Embedder(path).embed(texts) -> (N, E) float32``; no threads."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        batch_size: int = 32,
        cache_dir: str | Path | None = None,
        settings: EncoderSettings | None = None,
    ) -> None:
        checkpoint = load_bert_checkpoint(model_path or minilm_path())
        self.engine = EncoderRunner.from_checkpoint(
            checkpoint, cache_dir=cache_dir, settings=settings
        )
        self.tokenizer = checkpoint.tokenizer()
        self.batch_size = batch_size

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` in batches of similar length (less padding); order is preserved."""
        ids = self.tokenizer.encode_batch(list(texts))
        out = np.zeros((len(ids), self.engine.embedding_dim), dtype=np.float32)
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            out[chunk] = self.engine.encode([ids[i] for i in chunk])
        return out


class EmbeddingService:
    """Engine + dynamic batcher. Thread-safe; one instance per served model version."""

    def __init__(
        self,
        engine: EncoderRunner,
        tokenizer: BertTokenizer,
        batching: DynamicBatching | None = None,
        *,
        model_name: str = "embedding-model",
        model_version: str = "1",
        max_inputs: int = MAX_INPUTS_PER_REQUEST,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_version = model_version  # reported in responses (canary routing)
        # called with each formed batch's size (metrics); set by the server, None offline
        self.on_batch: Callable[[int], None] | None = None
        self.batcher: DynamicBatcher[_Item, np.ndarray] = DynamicBatcher(
            self._run_batch,
            batching,
            length_fn=lambda item: len(item.ids),
            name=f"embed-{model_name}",
        )
        self.max_inputs = min(max_inputs, self.batcher.config.max_queue_size)

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        batching: DynamicBatching | None = None,
        model_name: str | None = None,
        model_version: str = "1",
        cache_dir: str | Path | None = None,
        settings: EncoderSettings | None = None,
    ) -> EmbeddingService:
        """Load, build or reuse the compiled engine, start the batcher, run one warm-up call."""
        checkpoint = load_bert_checkpoint(path)
        engine = EncoderRunner.from_checkpoint(checkpoint, cache_dir=cache_dir, settings=settings)
        name = model_name or checkpoint.name
        service = cls(
            engine, checkpoint.tokenizer(), batching, model_name=name, model_version=model_version
        )
        service.warmup()
        return service

    @property
    def embedding_dim(self) -> int:
        return self.engine.embedding_dim

    def tokenize(self, inputs: Sequence[EmbeddingInput]) -> list[list[int]]:
        """Texts -> ids (truncated); token-id inputs are checked and truncated, used as given."""
        if isinstance(inputs, str) or not isinstance(inputs, Sequence) or len(inputs) == 0:
            raise EmbeddingInputError("input must be a non-empty list of strings or token-id lists")
        if len(inputs) > self.max_inputs:
            raise EmbeddingInputError(
                f"at most {self.max_inputs} inputs per request, got {len(inputs)}"
            )
        texts = {i: x for i, x in enumerate(inputs) if isinstance(x, str)}
        encoded = dict(zip(texts, self.tokenizer.encode_batch(list(texts.values())), strict=True))
        rows = []
        for i, x in enumerate(inputs):
            rows.append(encoded[i] if i in texts else self._check_ids(x, f"input[{i}]"))
        return rows

    def _check_ids(self, ids: object, field: str) -> list[int]:
        if not isinstance(ids, Sequence) or len(ids) == 0:
            raise EmbeddingInputError(
                f"{field} must be a string or a non-empty list of token ids", field
            )
        vocab = self.engine.vocab_size
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int | np.integer) or not 0 <= t < vocab:
                raise EmbeddingInputError(f"{field}: token id {t!r} is not in [0, {vocab})", field)
        return self.engine.truncate(ids)

    def submit(self, inputs: Sequence[EmbeddingInput]) -> Future[EmbeddingResult]:
        """Validate and queue all inputs now (raises EmbeddingInputError / QueueFull / BatcherClosed).

        Cancelling the returned future drops the inputs that have not started running.
        """
        rows = self.tokenize(inputs)
        now = time.monotonic()
        items = [_Item(ids=row, submitted_at=now) for row in rows]
        return _gather(items, self.batcher.submit_many(items))

    def embed(
        self, inputs: Sequence[EmbeddingInput], timeout: float | None = None
    ) -> EmbeddingResult:
        """Blocking form of ``submit``; on timeout the queued inputs are cancelled."""
        future = self.submit(inputs)
        try:
            return future.result(timeout)
        except FutureTimeout:
            future.cancel()
            raise

    async def embed_async(self, inputs: Sequence[EmbeddingInput]) -> EmbeddingResult:
        """Awaitable form of ``submit``; cancelling the task cancels the queued inputs."""
        return await asyncio.wrap_future(self.submit(inputs))

    def warmup(self) -> None:
        """One engine call outside the batcher (first onnxruntime run allocates); for readiness."""
        self.engine.encode([self.tokenizer.encode("warm up")])

    def stats(self) -> BatcherStats:
        return self.batcher.stats()

    def close(self) -> None:
        self.batcher.close()

    def _run_batch(self, items: list[_Item]) -> list[np.ndarray]:
        if self.on_batch is not None:
            with contextlib.suppress(Exception):  # metrics must never fail a batch
                self.on_batch(len(items))
        start = time.monotonic()
        vectors = self.engine.encode([it.ids for it in items])  # (B, E)
        compute = time.monotonic() - start
        for it in items:
            it.started_at, it.compute_s = start, compute
        return list(vectors)


def _gather(items: list[_Item], futures: list[Future[np.ndarray]]) -> Future[EmbeddingResult]:
    """One future for all of a request's inputs; the first failure fails it and cancels the rest.

    The returned future stays PENDING until it resolves, so ``cancel()`` (e.g. asyncio task
    cancellation through ``wrap_future``) works and drops the inputs not yet running.
    """
    result: Future[EmbeddingResult] = Future()
    lock, remaining = threading.Lock(), [len(futures)]

    def on_done(f: Future[np.ndarray]) -> None:
        if f.cancelled():
            return
        exc = f.exception()
        with lock:
            remaining[0] -= 1
            if result.done() or (exc is None and remaining[0]):
                return
            if exc is None:
                with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
                    result.set_result(_assemble(items, [fut.result() for fut in futures]))
        if exc is not None:
            with contextlib.suppress(InvalidStateError):
                result.set_exception(exc)
            for other in futures:
                other.cancel()

    def on_result_done(r: Future[EmbeddingResult]) -> None:
        if r.cancelled():
            for f in futures:
                f.cancel()

    result.add_done_callback(on_result_done)
    for f in futures:
        f.add_done_callback(on_done)
    return result


def _assemble(items: list[_Item], vectors: list[np.ndarray]) -> EmbeddingResult:
    return EmbeddingResult(
        vectors=np.stack(vectors).astype(np.float32, copy=False),
        prompt_tokens=sum(len(it.ids) for it in items),
        queue_time_s=max(it.started_at - it.submitted_at for it in items),
        compute_time_s=max(it.compute_s for it in items),
    )
