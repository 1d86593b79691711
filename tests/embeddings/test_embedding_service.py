"""EmbeddingService (engine + dynamic batcher) and the offline Embedder, against sentence-transformers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from embedding_cases import SENTENCES, cosine_rows

from inferflow.embeddings.dynamic_batcher import BatcherClosed
from inferflow.embeddings.encoder_runner import EncoderRunner
from inferflow.embeddings.service import (
    Embedder,
    EmbeddingInputError,
    EmbeddingService,
    _gather,
    _Item,
)
from inferflow.stages.batching import DynamicBatching

COSINE = 0.9999


@pytest.fixture
def service(minilm_engine: EncoderRunner) -> Iterator[EmbeddingService]:
    tokenizer = minilm_engine.checkpoint.tokenizer()
    config = DynamicBatching(max_num_seqs=8, max_delay_ms=10.0, max_queue_size=64)
    svc = EmbeddingService(minilm_engine, tokenizer, config, model_name="all-MiniLM-L6-v2")
    yield svc
    svc.close()


def concurrently(fn: object, args: list[object]) -> list[object]:
    """Run fn(arg) in one thread per arg, all released together by a barrier."""
    barrier, results = threading.Barrier(len(args)), [None] * len(args)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = fn(args[i])  # type: ignore[operator]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_one_request_with_many_inputs_matches_sentence_transformers(
    service: EmbeddingService, minilm_reference: np.ndarray
) -> None:
    result = service.embed(SENTENCES)
    assert result.vectors.shape == (len(SENTENCES), 384)
    assert cosine_rows(result.vectors, minilm_reference).min() >= COSINE
    lengths = [len(r) for r in service.tokenizer.encode_batch(SENTENCES)]
    assert result.prompt_tokens == sum(lengths)  # after truncation: the long one counts 256
    assert max(lengths) == 256
    assert result.queue_time_s >= 0 and result.compute_time_s > 0


def test_32_concurrent_clients_are_batched_and_match_sentence_transformers(
    service: EmbeddingService, minilm_reference: np.ndarray
) -> None:
    requests = [SENTENCES[i % len(SENTENCES)] for i in range(32)]
    results = concurrently(lambda text: service.embed([text]), requests)
    vectors = np.concatenate([r.vectors for r in results])  # type: ignore[attr-defined]
    expected = minilm_reference[[i % len(SENTENCES) for i in range(32)]]
    assert cosine_rows(vectors, expected).min() >= COSINE
    stats = service.stats()
    assert stats.items_processed == 32
    assert max(stats.batch_size_histogram) > 1  # requests shared engine calls
    assert stats.batches_formed < 32


def test_token_id_inputs_are_used_as_given(service: EmbeddingService) -> None:
    ids = service.tokenizer.encode("The quick brown fox")
    by_text, by_ids = service.embed(["The quick brown fox"]), service.embed([ids])
    np.testing.assert_allclose(by_ids.vectors, by_text.vectors, atol=1e-6)
    assert by_ids.prompt_tokens == len(ids)
    too_long = service.embed([[101] + [2088] * 400])
    assert too_long.prompt_tokens == 256  # truncated to the model's max length


@pytest.mark.parametrize(
    ("inputs", "field", "message"),
    [
        ([], "input", "non-empty list"),
        ("just a string", "input", "non-empty list"),
        (["ok", []], "input[1]", "non-empty list of token ids"),
        (["ok", [101, 30522]], "input[1]", "token id 30522"),
        ([[101, -1]], "input[0]", "token id -1"),
        ([[101, True]], "input[0]", "token id True"),
        ([["a", "b"]], "input[0]", "token id 'a'"),
        (["x"] * 65, "input", "at most 64 inputs"),
    ],
)
def test_invalid_inputs_name_the_field(
    service: EmbeddingService, inputs: object, field: str, message: str
) -> None:
    with pytest.raises(EmbeddingInputError, match=message) as err:
        service.embed(inputs)  # type: ignore[arg-type]
    assert err.value.field == field


def test_embed_async_and_closed_service(service: EmbeddingService) -> None:
    result = asyncio.run(service.embed_async(["hello world", "Short."]))
    np.testing.assert_allclose(
        result.vectors, service.embed(["hello world", "Short."]).vectors, atol=1e-6
    )
    service.close()
    with pytest.raises(BatcherClosed):
        service.embed(["after close"])


def test_offline_embedder_matches_sentence_transformers(
    minilm: Path, engine_cache: Path, minilm_reference: np.ndarray
) -> None:
    vectors = Embedder(minilm, batch_size=5, cache_dir=engine_cache).embed(SENTENCES)
    assert vectors.dtype == np.float32 and vectors.shape == (len(SENTENCES), 384)
    assert cosine_rows(vectors, minilm_reference).min() >= COSINE


def make_items(n: int) -> list[_Item]:
    return [
        _Item(ids=[101] * (i + 2), submitted_at=0.0, started_at=0.5, compute_s=0.1)
        for i in range(n)
    ]


def test_gather_assembles_in_input_order_whatever_the_completion_order() -> None:
    futures: list[Future[np.ndarray]] = [Future() for _ in range(3)]
    result = _gather(make_items(3), futures)
    for i in (2, 0, 1):
        assert not result.done()
        futures[i].set_result(np.full(4, float(i), dtype=np.float32))
    out = result.result(0)
    np.testing.assert_array_equal(out.vectors[:, 0], [0.0, 1.0, 2.0])
    assert (out.prompt_tokens, out.queue_time_s, out.compute_time_s) == (2 + 3 + 4, 0.5, 0.1)


def test_gather_fails_on_first_error_and_cancels_the_rest() -> None:
    futures: list[Future[np.ndarray]] = [Future() for _ in range(3)]
    result = _gather(make_items(3), futures)
    futures[1].set_exception(RuntimeError("engine failed"))
    with pytest.raises(RuntimeError, match="engine failed"):
        result.result(0)
    assert futures[0].cancelled() and futures[2].cancelled()


def test_cancelling_the_request_cancels_its_queued_inputs() -> None:
    futures: list[Future[np.ndarray]] = [Future() for _ in range(2)]
    futures[0].set_running_or_notify_cancel()  # already in a batch: cannot be cancelled
    result = _gather(make_items(2), futures)
    assert result.cancel()
    assert not futures[0].cancelled() and futures[1].cancelled()
    futures[0].set_result(np.zeros(4, dtype=np.float32))  # late completion is harmless
    assert result.cancelled()
