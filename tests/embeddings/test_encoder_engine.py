"""Encoder engine vs sentence-transformers (independent oracle) on MiniLM and tiny seeded BERTs."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from embedding_cases import SENTENCES, SETTINGS, cosine_rows

from inferflow.embeddings.encoder_runner import (
    EncoderInputError,
    EncoderRunner,
    cached_encoder_model,
    make_encoder_inputs,
)
from inferflow.models.bert import load_bert_checkpoint

COSINE = 0.9999


def test_minilm_single_inputs_match_sentence_transformers(
    minilm_engine: EncoderRunner, minilm_reference: np.ndarray
) -> None:
    tok = minilm_engine.checkpoint.tokenizer()
    ours = np.concatenate([minilm_engine.encode([tok.encode(s)]) for s in SENTENCES])
    assert ours.shape == (len(SENTENCES), 384)
    assert cosine_rows(ours, minilm_reference).min() >= COSINE
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # Normalize module


def test_minilm_padded_batch_matches_sentence_transformers(
    minilm_engine: EncoderRunner, minilm_reference: np.ndarray
) -> None:
    ids = minilm_engine.checkpoint.tokenizer().encode_batch(SENTENCES)
    assert len({len(r) for r in ids}) > 5  # a real padded batch: lengths 2..256
    ours = minilm_engine.encode(ids)
    assert cosine_rows(ours, minilm_reference).min() >= COSINE


def test_long_input_is_truncated_to_max_seq_length(minilm_engine: EncoderRunner) -> None:
    tok = minilm_engine.checkpoint.tokenizer()
    long_ids = tok.encode(SENTENCES[3])
    assert minilm_engine.max_length == 256  # sentence_bert_config.json, not tokenizer.json's 128
    assert len(long_ids) == 256 and long_ids[0] == 101 and long_ids[-1] == 102
    more = tok.encode(SENTENCES[3] + " and even more words at the very end")
    np.testing.assert_array_equal(long_ids, more)
    # ids longer than max_length (token-id input) are cut by the engine, not rejected
    extended = long_ids + [1000] * 50
    np.testing.assert_allclose(
        minilm_engine.encode([extended]), minilm_engine.encode([long_ids[:256]]), atol=1e-6
    )


def test_padding_does_not_change_a_row(minilm_engine: EncoderRunner) -> None:
    short = [101, 7592, 2088, 102]
    alone = minilm_engine.encode([short])
    padded = minilm_engine.encode([short, list(range(1000, 1200))])[:1]
    np.testing.assert_allclose(padded, alone, atol=1e-5)


def test_make_encoder_inputs_right_pads() -> None:
    inputs = make_encoder_inputs([[5, 6, 7], [8]], pad_id=0)
    np.testing.assert_array_equal(inputs["input_ids"], [[5, 6, 7], [8, 0, 0]])
    np.testing.assert_array_equal(inputs["attention_mask"], [[1, 1, 1], [1, 0, 0]])
    np.testing.assert_array_equal(inputs["token_type_ids"], np.zeros((2, 3)))


def test_invalid_rows_are_rejected_with_their_index(minilm_engine: EncoderRunner) -> None:
    with pytest.raises(EncoderInputError, match="input 1 has no tokens") as err:
        minilm_engine.encode([[101, 102], []])
    assert err.value.index == 1
    with pytest.raises(EncoderInputError, match=r"token id 30522 outside"):
        minilm_engine.encode([[101, 30522, 102]])
    assert minilm_engine.encode([]).shape == (0, 384)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("cls_raw", {"pooling": ("cls",)}),
        ("max_mean_norm", {"pooling": ("max", "mean"), "normalize": True}),
        ("sqrt_len_tanh_gelu", {"pooling": ("mean_sqrt_len_tokens",), "hidden_act": "gelu_new"}),
        ("bf16_relu", {"dtype": "bfloat16", "hidden_act": "relu"}),
    ],
)
def test_tiny_berts_match_sentence_transformers(
    name: str,
    kwargs: dict[str, Any],
    make_bert: Callable[..., Path],
    st_oracle: Callable[[Path], Any],
    engine_cache: Path,
) -> None:
    path = make_bert(name, **kwargs)
    engine = EncoderRunner.from_path(path, cache_dir=engine_cache, settings=SETTINGS)
    oracle = st_oracle(path)
    if kwargs.get("dtype") == "bfloat16":
        oracle = oracle.float()  # same bf16-rounded weights, computed in fp32 like our engine
    expected = oracle.encode(SENTENCES, batch_size=4, convert_to_numpy=True)
    ours = engine.encode(engine.checkpoint.tokenizer().encode_batch(SENTENCES))
    assert engine.max_length == 48
    assert (
        ours.shape == expected.shape == (len(SENTENCES), 32 * len(kwargs.get("pooling", ("mean",))))
    )
    assert cosine_rows(ours, expected).min() >= COSINE
    np.testing.assert_allclose(ours, expected, rtol=1e-3, atol=1e-4)


def test_engine_cache_builds_once_and_keys_on_weights_and_settings(
    make_bert: Callable[..., Path], tmp_path: Path
) -> None:
    mean = load_bert_checkpoint(make_bert("cache_mean", seed=1))
    first = cached_encoder_model(mean, tmp_path)
    assert not first.reused
    again = cached_encoder_model(mean, tmp_path)
    assert again.reused and again.path == first.path  # second start: no rebuild
    manifest = json.loads((first.path / "manifest.json").read_text())
    assert manifest["onnxruntime_version"] == ort.__version__
    assert manifest["weights_digest"] == mean.weights_digest()
    assert manifest["pooling"] == "mean"
    cls_ckpt = load_bert_checkpoint(make_bert("cache_cls", seed=1, pooling=("cls",)))
    assert cached_encoder_model(cls_ckpt, tmp_path).path != first.path  # settings in the key
    other = load_bert_checkpoint(make_bert("cache_seed2", seed=2))
    assert cached_encoder_model(other, tmp_path).path != first.path  # weights in the key
    assert sorted(p.name.startswith(".") for p in tmp_path.iterdir()) == [False] * 3  # no temp left
