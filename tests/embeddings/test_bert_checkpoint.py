"""Loading BERT checkpoints: MiniLM's sentence-transformers layout, plain HF folders, errors."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from inferflow.models.bert import PoolingConfig, load_bert_checkpoint, minilm_path
from inferflow.models.errors import CheckpointError


def test_minilm_path_points_at_the_packaged_model() -> None:
    path = minilm_path()
    assert (path / "model.safetensors").is_file() and (path / "modules.json").is_file()


def test_minilm_checkpoint_reads_architecture_pooling_and_max_length(minilm: Path) -> None:
    ckpt = load_bert_checkpoint(minilm)
    cfg = ckpt.config
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim) == (384, 6, 12, 32)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.hidden_act) == (30522, 1536, "gelu")
    # legacy pooling_mode_* booleans + a Normalize module in modules.json
    assert ckpt.pooling == PoolingConfig(modes=("mean",), normalize=True)
    assert ckpt.max_length == 256  # sentence_bert_config.json wins over tokenizer.json's 128
    assert ckpt.embedding_dim == 384


def test_tokenizer_adds_specials_truncates_and_never_pads(minilm: Path) -> None:
    tok = load_bert_checkpoint(minilm).tokenizer()
    assert tok.encode("") == [101, 102]
    assert tok.encode("hello world") == [101, 7592, 2088, 102]
    rows = tok.encode_batch(["hello", "word " * 1000])
    assert [len(r) for r in rows] == [3, 256]
    assert rows[1][-1] == 102  # truncation keeps [SEP]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_plain_hf_folder_means_mean_pooling_and_position_limit(
    make_bert: Callable[..., Path], tmp_path: Path
) -> None:
    path = copy_model(make_bert("plain_src", max_seq_length=None), tmp_path / "plain")
    (path / "modules.json").unlink()
    shutil.rmtree(path / "1_Pooling")
    ckpt = load_bert_checkpoint(path)
    assert ckpt.pooling == PoolingConfig(modes=("mean",), normalize=False)
    assert ckpt.max_length == 64  # tokenizer_config says 512, the position table has 64 rows


def test_prefixed_and_bf16_weights_load_as_float32(
    make_bert: Callable[..., Path], tmp_path: Path
) -> None:
    src = load_bert_checkpoint(make_bert("prefix_src"))
    weights = src.weights()
    path = copy_model(src.path, tmp_path / "prefixed")
    (path / "model.safetensors").unlink()
    save_file({f"bert.{k}": v for k, v in weights.items()}, str(path / "model.safetensors"))
    prefixed = load_bert_checkpoint(path).weights()
    assert prefixed.keys() == weights.keys()
    for k, v in weights.items():
        np.testing.assert_array_equal(prefixed[k], v)

    bf16 = load_bert_checkpoint(make_bert("bf16_src", dtype="bfloat16")).weights()
    w = bf16["embeddings.word_embeddings.weight"]
    assert w.dtype == np.float32
    # bf16 -> fp32 is exact: the low 16 mantissa bits are zero, values are not all zero
    assert not (w.view(np.uint32) & 0xFFFF).any() and np.abs(w).max() > 0.1


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: (p / "config.json").unlink(), "config.json is missing"),
        (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (lambda p: (p / "model.safetensors").unlink(), "no *.safetensors"),
        (lambda p: edit_json(p / "config.json", hidden_act="swish"), "hidden_act 'swish'"),
        (lambda p: edit_json(p / "config.json", num_attention_heads=5), "not divisible"),
        (lambda p: edit_json(p / "config.json", model_type="llama"), "is not BERT"),
        (
            lambda p: edit_json(p / "1_Pooling" / "config.json", pooling_mode="weightedmean"),
            "pooling mode 'weightedmean' unsupported",
        ),
        (
            lambda p: (p / "modules.json").write_text(
                json.dumps([{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}])
            ),
            "models.Dense' is not supported",
        ),
    ],
)
def test_bad_checkpoints_fail_with_one_clear_error(
    mutate: Callable[[Path], object], message: str, make_bert: Callable[..., Path], tmp_path: Path
) -> None:
    path = copy_model(make_bert("error_src"), tmp_path / "broken")
    mutate(path)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        load_bert_checkpoint(path)


def edit_json(file: Path, **changes: object) -> None:
    file.write_text(json.dumps({**json.loads(file.read_text()), **changes}))


def test_missing_weight_tensor_is_named(make_bert: Callable[..., Path], tmp_path: Path) -> None:
    from inferflow.models.bert_graph import build_bert_graph

    src = load_bert_checkpoint(make_bert("missing_src"))
    weights = src.weights()
    del weights["encoder.layer.1.output.dense.weight"]
    path = copy_model(src.path, tmp_path / "missing")
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=re.escape("encoder.layer.1.output.dense.weight")):
        build_bert_graph(load_bert_checkpoint(path))
