"""inferflow.testing.lora: the adapters and references the multi-LoRA oracle tests rely on."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferflow.lora import LoraSpec, load_peft_adapter
from inferflow.models.config import parse_model_config
from inferflow.models.tiny import make_checkpoint
from inferflow.testing.lora import (
    base_reference,
    make_peft_adapter,
    merged_reference,
    peft_reference,
    write_lora_adapter,
)

PROMPTS = [[1, 2, 3, 4, 5], [10, 20, 30]]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("lora_ref") / "base", seed=1)


@pytest.mark.slow  # eight greedy runs through transformers
def test_adapters_are_seeded_and_change_the_greedy_output(base: Path, tmp_path: Path) -> None:
    one = make_peft_adapter(base, tmp_path / "one", seed=3)
    same = make_peft_adapter(base, tmp_path / "same", seed=3)
    other = make_peft_adapter(base, tmp_path / "other", rank=4, rslora=True, seed=4,
                              targets=("q_proj", "v_proj", "down_proj"))
    name = "adapter_model.safetensors"
    assert (one / name).read_bytes() == (same / name).read_bytes()
    plain = base_reference(base, PROMPTS, 12)
    outs = {}
    for label, adapter in (("one", one), ("other", other)):
        outs[label] = peft_reference(base, adapter, PROMPTS, 12)
        assert outs[label] == merged_reference(base, adapter, PROMPTS, 12)
        assert all(len(o) == 12 for o in outs[label])
        assert outs[label] != plain
    assert outs["one"] != outs["other"]


def test_the_numpy_writer_makes_an_adapter_peft_reads(base: Path, tmp_path: Path) -> None:
    arch = parse_model_config(base / "config.json")
    path = write_lora_adapter(tmp_path / "np", arch, rank=4, targets=("k_proj", "up_proj"),
                              layers=[0, 2], seed=5, strength=0.5)
    ours = load_peft_adapter(path, "np", arch, LoraSpec(2, 8))
    assert set(ours.weights) == {(i, t) for i in (0, 2) for t in ("k_proj", "up_proj")}
    # peft applies it (the output moves) and its merged form agrees
    assert peft_reference(base, path, PROMPTS, 12) == merged_reference(base, path, PROMPTS, 12)
    assert peft_reference(base, path, PROMPTS, 12) != base_reference(base, PROMPTS, 12)
