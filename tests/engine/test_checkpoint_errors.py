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


def _edit_config(path: Path, **changes: object) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512, "rope_theta": 1e4}

# What inferflow does not compute, each a config.json edit -> the words its one line must say.
UNSUPPORTED: dict[str, tuple[dict[str, object], tuple[str, ...]]] = {
    "architecture": ({"architectures": ["DeepseekV3ForCausalLM"]}, ("'DeepseekV3ForCausalLM'", "LlamaForCausalLM")),
    "activation": ({"hidden_act": "quick_gelu"}, ("hidden_act='quick_gelu'", "gelu_pytorch_tanh")),
    "rope_type": ({"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, ("'proportional'", "yarn")),
    "longrope_incomplete": ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
                            ("'longrope'", "long_factor")),
    "partial_rotary": ({"partial_rotary_factor": 1.5}, ("partial_rotary_factor=1.5",)),
    "rope_key": ({"rope_parameters": {**_YARN, "mrope_section": [2, 2]}}, ("mrope_section=[2, 2]", "yarn")),
    "rope_spellings_disagree": ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_parameters": _YARN},
                                ("rope_scaling", "rope_parameters", "disagree")),
    "quantized": ({"quantization_config": {"quant_method": "gptq", "bits": 4}},
                  ("quantization_config", "'gptq'", "executor.precision")),
    "rope_incomplete": ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4}}, ("'linear'", "factor")),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_fields_are_one_line_naming_them(ckpt: Path, case: str) -> None:
    changes, words = UNSUPPORTED[case]
    _edit_config(ckpt, **changes)
    err = str(_error(ckpt))
    assert "config.json" in err and all(w in err for w in words), err


def test_qwen2_layer_types_are_the_truth(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "q", architecture="Qwen2ForCausalLM", **SMALL)
    full, sliding = "full_attention", "sliding_attention"
    _edit_config(path, use_sliding_window=True, sliding_window=64, max_window_layers=0, layer_types=[full])
    assert load_checkpoint(path).config.sliding_window is None  # layer_types win over max_window_layers
    _edit_config(path, layer_types=[sliding])
    assert load_checkpoint(path).config.sliding_window == 64
    _edit_config(path, use_sliding_window=False)  # transformers: no window without the switch
    assert load_checkpoint(path).config.sliding_window is None
    _edit_config(path, use_sliding_window=True, layer_types=["chunked_attention"])
    assert "layer_types 'chunked_attention' is not supported" in str(_error(path))


def test_mistral_without_sliding_window_key_has_transformers_default(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", architecture="MistralForCausalLM", **SMALL)
    cfg = json.loads((path / "config.json").read_text())
    del cfg["sliding_window"], cfg["max_position_embeddings"]
    (path / "config.json").write_text(json.dumps(cfg))
    arch = load_checkpoint(path).config  # MistralConfig's defaults: 4,096 and 131,072
    assert (arch.sliding_window, arch.max_position_embeddings) == (4096, 131072)


def _add_tensor(path: Path, name: str, value: object) -> None:
    from inferflow.models.safetensors_reader import SafetensorsFile
    from inferflow.models.safetensors_writer import save_safetensors

    st = SafetensorsFile(path / "model.safetensors")
    tensors = {n: st.read(n) for n in st.tensors}
    st.close()
    save_safetensors({**tensors, name: value}, path / "model.safetensors")


def test_a_tensor_the_model_would_not_use_is_refused(ckpt: Path) -> None:
    import numpy as np

    # Llama's attention_bias is false here: a bias in the files would be left out of the math
    _add_tensor(ckpt, "model.layers.0.self_attn.o_proj.bias", np.ones(64, np.float32))
    err = str(_error(ckpt, load_weights=True))
    assert "'model.layers.0.self_attn.o_proj.bias'" in err and "not used" in err


def test_tensors_transformers_ignores_are_ignored(tmp_path: Path) -> None:
    import numpy as np

    path = make_checkpoint(tmp_path / "tied", tie_word_embeddings=True, **SMALL)
    _add_tensor(path, "model.layers.0.self_attn.rotary_emb.inv_freq", np.ones(8, np.float32))
    st_embed = load_checkpoint(path).open_weights()
    embed = st_embed.embed
    st_embed.close()
    _add_tensor(path, "lm_head.weight", embed)  # the tied head, stored anyway: the same values
    load_checkpoint(path).open_weights().close()
    _add_tensor(path, "lm_head.weight", embed + 1)  # a different head: which one is the model?
    assert "'lm_head.weight'" in str(_error(path, load_weights=True))


def test_longrope_is_served_up_to_its_original_context(ckpt: Path) -> None:
    """Phi-3/Phi-4's longrope: the short factors up to original_max_position_embeddings; a longer
    served context is one line naming the knob that serves it."""
    cfg = json.loads((ckpt / "config.json").read_text())
    half = cfg["head_dim"] // 2
    _edit_config(ckpt, max_position_embeddings=4096, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 256,
        "short_factor": [1.0 + i / 10 for i in range(half)], "long_factor": [4.0] * half})
    arch = load_checkpoint(ckpt).config
    assert (arch.rope.rope_type, arch.rope.max_context) == ("longrope", 256)
    arch.check_context(ckpt / "config.json", 256, "model.max_model_len")
    with pytest.raises(CheckpointError, match=r"original_max_position_embeddings=256.*model.max_model_len=256"):
        arch.check_context(ckpt / "config.json", 257, "model.max_model_len")
