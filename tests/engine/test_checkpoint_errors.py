"""Broken or unsupported checkpoints fail with one clear message naming the file and problem."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.errors import CheckpointError
from inferflow.models.tiny import make_checkpoint

SMALL = {"num_layers": 1, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}


@pytest.fixture()
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "m", **SMALL)


def _error(path: Path, load_weights: bool = False) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        ck = load_checkpoint(path)
        if load_weights:
            ck.open_weights()
        else:
            _ = ck.tokenizer
    assert "\n" not in str(info.value)
    return info.value


def test_missing_folder(tmp_path: Path) -> None:
    err = _error(tmp_path / "nope")
    assert "does not exist" in str(err) and "nope" in str(err)


def test_missing_config(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    assert "config.json is missing" in str(_error(ckpt))


def test_unknown_architecture(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    err = str(_error(ckpt))
    assert "config.json" in err and "GPT2LMHeadModel" in err and "LlamaForCausalLM" in err


def test_missing_weights(ckpt: Path) -> None:
    (ckpt / "model.safetensors").unlink()
    assert "model.safetensors" in str(_error(ckpt))


def test_truncated_safetensors(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    err = str(_error(ckpt, load_weights=True))
    assert "model.safetensors" in err and "truncated" in err


def test_tensor_shape_mismatch(ckpt: Path, tmp_path: Path) -> None:
    other = make_checkpoint(tmp_path / "wide", **{**SMALL, "intermediate_size": 128})
    shutil.copy(other / "model.safetensors", ckpt / "model.safetensors")
    err = str(_error(ckpt, load_weights=True))
    assert "mlp" in err and "shape" in err and "config.json implies" in err


def test_missing_shard(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "sharded", shards=2, **SMALL)
    next(path.glob("model-00002-*.safetensors")).unlink()
    assert "model-00002-of-00002.safetensors" in str(_error(path))


def test_missing_tokenizer(ckpt: Path) -> None:
    (ckpt / "tokenizer.json").unlink()
    assert "tokenizer.json is missing" in str(_error(ckpt))


def test_untied_checkpoint_without_lm_head(ckpt: Path) -> None:
    from inferflow.models.safetensors_reader import SafetensorsFile
    from inferflow.models.safetensors_writer import save_safetensors

    st = SafetensorsFile(ckpt / "model.safetensors")
    tensors = {n: st.read(n) for n in st.tensors if n != "lm_head.weight"}
    st.close()
    save_safetensors(tensors, ckpt / "model.safetensors")
    assert "lm_head.weight" in str(_error(ckpt, load_weights=True))


def test_tiny_checkpoints_are_deterministic(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a", **SMALL)
    b = make_checkpoint(tmp_path / "b", **SMALL)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_the_checkpoint_helper_tokenizer_has_every_model_id(tmp_path: Path) -> None:
    from inferflow.models.tokenizer import Tokenizer

    path = make_checkpoint(tmp_path / "v2048", vocab_size=2048, num_layers=1)
    assert Tokenizer(path).vocab_size == 2048 == load_checkpoint(path).config.vocab_size
    with pytest.raises(ValueError, match=r"^vocab_size: 300000 tokens cannot be trained"):
        make_checkpoint(tmp_path / "huge", vocab_size=300000, num_layers=1)
    assert not list((tmp_path / "huge").glob("*.safetensors"))  # refused before any weights
