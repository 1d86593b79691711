"""load_peft_adapter against adapters peft itself saved: the weights and scaling peft uses, and
every adapter the engines would not serve exactly refused in one line naming the feature."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from inferflow.lora.adapter import LORA_TARGETS, LoraError, LoraSpec, load_peft_adapter
from inferflow.models.config import ModelArch, parse_model_config
from inferflow.models.family import MoE
from inferflow.models.safetensors_reader import SafetensorsFile
from inferflow.models.safetensors_writer import save_safetensors
from inferflow.models.tiny import make_checkpoint
from inferflow.testing.lora import make_peft_adapter

SPEC = LoraSpec(max_loras=4, max_lora_rank=16)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lora_adapter")


@pytest.fixture(scope="module")
def base(root: Path) -> Path:
    # GQA (8 q heads, 2 kv heads) and intermediate 384: every projection a different shape
    return make_checkpoint(root / "base", seed=1)


@pytest.fixture(scope="module")
def arch(base: Path) -> ModelArch:
    return parse_model_config(base / "config.json")


@pytest.fixture(scope="module")
def adapter_dir(root: Path, base: Path) -> Path:
    return make_peft_adapter(base, root / "all", rank=8, alpha=16, seed=1)


def _peft_modules(base: Path, adapter: Path) -> dict[tuple[int, str], Any]:
    """peft's LoRA layers of ``adapter`` on ``base``, by (layer, target)."""
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model: Any = PeftModel.from_pretrained(model, adapter)
    out = {}
    for i, layer in enumerate(peft_model.base_model.model.model.layers):
        for target in LORA_TARGETS:
            block = layer.mlp if target in ("gate_proj", "up_proj", "down_proj") else layer.self_attn
            module = getattr(block, target)
            if hasattr(module, "lora_A") and "default" in module.lora_A:
                out[(i, target)] = module
    return out


def _variant(src: Path, dst: Path, **config: Any) -> Path:
    """A copy of adapter ``src`` with adapter_config.json keys set (None: removed)."""
    shutil.copytree(src, dst)
    raw = json.loads((dst / "adapter_config.json").read_text())
    for key, value in config.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    (dst / "adapter_config.json").write_text(json.dumps(raw))
    return dst


def _tensors(path: Path) -> dict[str, np.ndarray]:
    f = SafetensorsFile(path / "adapter_model.safetensors")
    try:
        return {k: f.read(k) for k in f.tensors}
    finally:
        f.close()


def _refused(path: Path, arch: ModelArch, spec: LoraSpec = SPEC, **kw: Any) -> LoraError:
    with pytest.raises(LoraError) as info:
        load_peft_adapter(path, "ad", arch, spec, **kw)
    err = info.value
    assert "\n" not in str(err)
    assert err.field == kw.get("field_name", "lora_path")
    assert str(err).startswith(f"{err.field}: adapter 'ad': ")
    return err


# --- what is served ------------------------------------------------------------------------------


def test_weights_and_scaling_equal_peft_and_give_its_update(base: Path, arch: ModelArch,
                                                            adapter_dir: Path) -> None:
    import torch

    adapter = load_peft_adapter(adapter_dir, "all", arch, SPEC)
    modules = _peft_modules(base, adapter_dir)
    assert set(adapter.weights) == {(i, t) for i in range(arch.num_layers) for t in LORA_TARGETS}
    assert set(modules) == set(adapter.weights)
    assert (adapter.name, adapter.path, adapter.rank) == ("all", adapter_dir, 8)
    assert adapter.scaling == 2.0 and adapter.base_model == str(base)
    rng = np.random.default_rng(0)
    for key, (a, b) in adapter.weights.items():
        module = modules[key]
        assert a.dtype == b.dtype == np.float32 and a.flags.c_contiguous and b.flags.c_contiguous
        np.testing.assert_array_equal(a, module.lora_A["default"].weight.detach().numpy().T)
        np.testing.assert_array_equal(b, module.lora_B["default"].weight.detach().numpy().T)
        assert module.scaling["default"] == adapter.scaling
        # the layer's output minus the base layer's is scaling * x @ A @ B
        x = rng.standard_normal((3, a.shape[0])).astype(np.float32)
        with torch.no_grad():
            xt = torch.from_numpy(x)
            delta = (module(xt) - module.base_layer(xt)).numpy()
        np.testing.assert_allclose(delta, adapter.scaling * (x @ a @ b), rtol=1e-4, atol=1e-5)
    assert adapter.nbytes == sum(a.nbytes + b.nbytes for a, b in adapter.weights.values())


def test_rslora_bf16_subset_adapter(root: Path, base: Path, arch: ModelArch) -> None:
    path = make_peft_adapter(base, root / "rs", rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
                             seed=2, rslora=True, dtype="bfloat16")
    assert {i.dtype for i in SafetensorsFile(path / "adapter_model.safetensors").tensors.values()} == {"BF16"}
    adapter = load_peft_adapter(path, "rs", arch, SPEC)
    modules = _peft_modules(base, path)
    assert adapter.scaling == 4.0 == modules[(0, "q_proj")].scaling["default"]  # 8 / sqrt(4)
    assert set(adapter.weights) == set(modules) == {
        (i, t) for i in range(arch.num_layers) for t in ("q_proj", "v_proj", "down_proj")}
    for key, (a, b) in adapter.weights.items():
        assert a.dtype == np.float32 and a.shape[1] == b.shape[0] == 4
        np.testing.assert_array_equal(a, modules[key].lora_A["default"].weight.detach().numpy().T)
        np.testing.assert_array_equal(b, modules[key].lora_B["default"].weight.detach().numpy().T)


def test_layers_to_transform_leaves_the_other_layers_absent(root: Path, base: Path,
                                                            arch: ModelArch) -> None:
    path = make_peft_adapter(base, root / "some_layers", targets=("o_proj", "up_proj"), seed=3,
                             layers_to_transform=[1, 3])
    adapter = load_peft_adapter(path, "x", arch, SPEC)
    assert set(adapter.weights) == {(i, t) for i in (1, 3) for t in ("o_proj", "up_proj")}


def test_a_regex_target_modules_is_decided_by_the_tensors(root: Path, base: Path,
                                                          arch: ModelArch) -> None:
    path = make_peft_adapter(base, root / "regex", targets=(), seed=4,
                             target_modules=r".*\.(k_proj|gate_proj)")
    assert isinstance(json.loads((path / "adapter_config.json").read_text())["target_modules"], str)
    adapter = load_peft_adapter(path, "x", arch, SPEC)
    assert {t for _, t in adapter.weights} == {"k_proj", "gate_proj"}
    spec = LoraSpec(4, 16, ("q_proj", "k_proj"))
    assert "'gate_proj' is not in lora.target_modules" in str(_refused(path, arch, spec))


def test_rank_equal_to_max_lora_rank_and_an_attention_only_adapter_on_moe(
        root: Path, base: Path, arch: ModelArch) -> None:
    path = make_peft_adapter(base, root / "r16", rank=16, targets=("q_proj", "o_proj"), seed=5)
    assert load_peft_adapter(path, "x", arch, SPEC).rank == 16
    moe = dataclasses.replace(arch, moe=MoE(4, 2, 64, True, (True,) * arch.num_layers))
    assert len(load_peft_adapter(path, "x", moe, SPEC).weights) == 2 * arch.num_layers


# --- what is refused -----------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "words"), [
    ({"use_dora": True}, "DoRA"),
    ({"bias": "lora_only"}, "trained biases"),
    ({"bias": "all"}, "trained biases"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"rank_pattern": {"q_proj": 4}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern"),
    ({"lora_bias": True}, "lora_bias"),
], ids=lambda v: str(v) if isinstance(v, str) else next(iter(v)))
def test_peft_features_the_engines_do_not_compute(root: Path, base: Path, arch: ModelArch,
                                                  extra: dict[str, Any], words: str) -> None:
    name = "_".join(f"{k}{v}" for k, v in extra.items()).replace("'", "")
    path = make_peft_adapter(base, root / f"refused_{name}"[:60], targets=("q_proj", "v_proj"),
                             seed=6, **extra)
    assert words in str(_refused(path, arch))


@pytest.mark.parametrize("target", ["lm_head", "embed_tokens"])
def test_targets_outside_the_projections(root: Path, base: Path, arch: ModelArch, target: str) -> None:
    path = make_peft_adapter(base, root / f"target_{target}", targets=("q_proj", target), seed=7)
    assert f"target module {target!r} is not supported" in str(_refused(path, arch))
    # the tensors alone (config listing only q_proj) are refused too
    variant = _variant(path, root / f"target_{target}_keys", target_modules=["q_proj"])
    assert "is not supported (LoRA A/B weights of" in str(_refused(variant, arch))


@pytest.mark.parametrize("key", ["target_parameters", "trainable_token_indices",
                                 "layer_replication", "alora_invocation_tokens", "use_qalora",
                                 "fan_in_fan_out"])
def test_other_config_features_are_refused_by_name(root: Path, arch: ModelArch,
                                                   adapter_dir: Path, key: str) -> None:
    path = _variant(adapter_dir, root / f"cfg_{key}", **{key: [1] if key != "use_qalora" else True})
    assert f"({key}=" in str(_refused(path, arch))


def test_another_peft_type(root: Path, arch: ModelArch, adapter_dir: Path) -> None:
    path = _variant(adapter_dir, root / "ia3", peft_type="IA3")
    assert "peft_type 'IA3' is not supported" in str(_refused(path, arch))


def test_rank_above_max_lora_rank(root: Path, base: Path, arch: ModelArch) -> None:
    path = make_peft_adapter(base, root / "r32", rank=32, targets=("q_proj",), seed=8)
    assert "r=32 exceeds lora.max_lora_rank=16" in str(_refused(path, arch))
    assert "r=8 exceeds lora.max_lora_rank=4" in str(
        _refused(make_peft_adapter(base, root / "r8", targets=("q_proj",)), arch, LoraSpec(4, 4)))


@pytest.mark.parametrize("r", [0, -2, 2.5, "8", True])
def test_a_bad_r_or_alpha(root: Path, arch: ModelArch, adapter_dir: Path, r: object) -> None:
    path = _variant(adapter_dir, root / f"bad_r_{r}", r=r)
    assert f"r={r!r} must be a positive integer" in str(_refused(path, arch))
    path = _variant(adapter_dir, root / f"bad_alpha_{r}", lora_alpha=str(r))
    assert "must be a number" in str(_refused(path, arch))


def test_a_target_the_engine_was_not_built_with(arch: ModelArch, adapter_dir: Path) -> None:
    spec = LoraSpec(4, 16, ("q_proj", "k_proj", "v_proj", "o_proj"))
    err = _refused(adapter_dir, arch, spec, field_name="lora.adapters.ad")
    assert "target module 'gate_proj' is not in lora.target_modules (q_proj, k_proj, v_proj, o_proj)" in str(err)


def test_shapes_of_another_base_model(arch: ModelArch, adapter_dir: Path) -> None:
    wider = dataclasses.replace(arch, intermediate_size=512)
    err = str(_refused(adapter_dir, wider))
    assert "down_proj.lora_A.weight' has shape [8, 384], the base model and r=8 need [8, 512]" in err
    assert "shape" in str(_refused(adapter_dir, dataclasses.replace(arch, num_kv_heads=4)))
    fewer = dataclasses.replace(arch, num_layers=2)
    assert "layer 2 >= the base model's 2 layers" in str(_refused(adapter_dir, fewer))


def test_config_rank_that_does_not_match_the_tensors(root: Path, arch: ModelArch,
                                                     adapter_dir: Path) -> None:
    path = _variant(adapter_dir, root / "r_mismatch", r=4)
    assert "has shape [8, 384], the base model and r=4 need [4, 384]" in str(_refused(path, arch))


def test_mlp_targets_on_mixture_of_experts_layers(arch: ModelArch, adapter_dir: Path) -> None:
    sparse = tuple(i % 2 == 1 for i in range(arch.num_layers))
    moe = dataclasses.replace(arch, moe=MoE(4, 2, 64, True, sparse))
    assert "layers.1.mlp.down_proj" in (err := str(_refused(adapter_dir, moe)))
    assert "mixture-of-experts MLP is not supported" in err


def test_pickled_weights_and_missing_files(root: Path, arch: ModelArch, adapter_dir: Path,
                                           tmp_path: Path) -> None:
    pickled = shutil.copytree(adapter_dir, root / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    assert "adapter_model.bin (a pickle) is not read" in str(_refused(pickled, arch))
    (pickled / "adapter_model.bin").unlink()
    assert "adapter_model.safetensors is missing" in str(_refused(pickled, arch))
    assert "is not a folder" in str(_refused(tmp_path / "nowhere", arch))
    assert "adapter_config.json is missing" in str(_refused(tmp_path, arch))
    (tmp_path / "adapter_config.json").write_text("{not json")
    assert "is not valid JSON" in str(_refused(tmp_path, arch))
    (tmp_path / "adapter_config.json").write_text("[1]")
    assert "must hold a JSON object" in str(_refused(tmp_path, arch))


def _rewrite(src: Path, dst: Path, tensors: dict[str, np.ndarray]) -> Path:
    shutil.copytree(src, dst)
    save_safetensors(tensors, dst / "adapter_model.safetensors")
    return dst


def test_broken_weight_files(root: Path, arch: ModelArch, adapter_dir: Path) -> None:
    tensors = _tensors(adapter_dir)
    key_b = "base_model.model.model.layers.2.self_attn.k_proj.lora_B.weight"
    path = _rewrite(adapter_dir, root / "no_b", {k: v for k, v in tensors.items() if k != key_b})
    assert "layer 2 k_proj: lora_B is missing" in str(_refused(path, arch))
    key_a = key_b.replace("lora_B", "lora_A")
    path = _rewrite(adapter_dir, root / "no_a", {k: v for k, v in tensors.items() if k != key_a})
    assert "layer 2 k_proj: lora_A is missing" in str(_refused(path, arch))
    extra = {**tensors, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.ones(128, np.float32)}
    assert "lora_magnitude_vector' is not supported" in str(_refused(_rewrite(adapter_dir, root / "extra", extra), arch))
    wrong_block = {"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": tensors[key_a]}
    assert "q_proj is not under mlp" in str(_refused(_rewrite(adapter_dir, root / "block", wrong_block), arch))
    assert "holds no LoRA weights" in str(_refused(_rewrite(adapter_dir, root / "empty", {}), arch))
    ints = {key_a: tensors[key_a].astype(np.int32), key_b: tensors[key_b]}
    shutil.copytree(adapter_dir, root / "ints")
    from safetensors.numpy import save_file
    save_file(ints, str(root / "ints" / "adapter_model.safetensors"))
    assert "has dtype I32 (expected F32, F16 or BF16)" in str(_refused(root / "ints", arch))
    truncated = shutil.copytree(adapter_dir, root / "truncated")
    data = (truncated / "adapter_model.safetensors").read_bytes()
    (truncated / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    assert "truncated safetensors file" in str(_refused(truncated, arch))


def test_fp16_tensors_are_widened(root: Path, base: Path, arch: ModelArch, adapter_dir: Path) -> None:
    tensors = _tensors(adapter_dir)
    shutil.copytree(adapter_dir, root / "fp16")
    save_safetensors(tensors, root / "fp16" / "adapter_model.safetensors", "float16")
    ours = load_peft_adapter(root / "fp16", "h", arch, SPEC)
    full = load_peft_adapter(adapter_dir, "f", arch, SPEC)
    for key, (a, b) in ours.weights.items():
        assert a.dtype == np.float32
        np.testing.assert_array_equal(a, full.weights[key][0].astype(np.float16).astype(np.float32))
        np.testing.assert_array_equal(b, full.weights[key][1].astype(np.float16).astype(np.float32))
