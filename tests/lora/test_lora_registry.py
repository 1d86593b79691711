"""LoraRegistry: adapters by name, checked on add, a host LRU of max_cpu_loras with re-reads."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
from lora_fixtures import small_arch

from inferflow.lora import LoraAdapter, LoraError, LoraSpec
from inferflow.lora.registry import LoraRegistry
from inferflow.models.config import ModelArch
from inferflow.testing.lora import write_lora_adapter

SPEC = LoraSpec(max_loras=2, max_lora_rank=8)


@pytest.fixture
def arch(tmp_path: Path) -> ModelArch:
    return small_arch(tmp_path / "base")


@pytest.fixture
def folders(tmp_path: Path, arch: ModelArch) -> dict[str, Path]:
    return {name: write_lora_adapter(tmp_path / name, arch, rank=4, seed=seed)
            for seed, name in enumerate("abcd")}


def _same(x: LoraAdapter, y: LoraAdapter) -> None:
    assert x.weights.keys() == y.weights.keys()
    for key, (a, b) in x.weights.items():
        np.testing.assert_array_equal(a, y.weights[key][0])
        np.testing.assert_array_equal(b, y.weights[key][1])


def test_add_get_names_and_paths(arch: ModelArch, folders: dict[str, Path]) -> None:
    reg = LoraRegistry(SPEC, arch, max_cpu_loras=4)
    added = reg.add("b", folders["b"])
    reg.add("a", str(folders["a"]))
    assert reg.names() == ["b", "a"] and len(reg) == 2
    assert "a" in reg and "c" not in reg
    assert reg.path("a") == folders["a"]
    assert reg.get("b") is added and added.name == "b" and added.scaling == 4.0
    assert reg.loads == 2 and reg.unloads == 0 and reg.host_evictions == 0
    with pytest.raises(KeyError):
        reg.get("c")
    with pytest.raises(KeyError):
        reg.path("c")
    assert reg.version("c") is None and reg.version("a") != reg.version("b")


def test_add_refuses_duplicates_empty_names_and_bad_adapters(arch: ModelArch, folders: dict[str, Path],
                                                            tmp_path: Path) -> None:
    reg = LoraRegistry(SPEC, arch, max_cpu_loras=4)
    reg.add("a", folders["a"])
    with pytest.raises(LoraError, match=r"^lora_name: adapter 'a' is already loaded$") as info:
        reg.add("a", folders["b"])
    assert info.value.field == "lora_name"
    with pytest.raises(LoraError, match=r"^lora_name: an adapter name must not be empty$"):
        reg.add("", folders["b"])
    big = write_lora_adapter(tmp_path / "big", arch, rank=16)
    with pytest.raises(LoraError, match=r"exceeds lora.max_lora_rank=8") as info:
        reg.add("big", big, field_name="lora.adapters.big")
    assert info.value.field == "lora.adapters.big"
    assert reg.names() == ["a"] and reg.loads == 1
    with pytest.raises(ValueError, match=r"max_cpu_loras must be >= 1"):
        LoraRegistry(SPEC, arch, max_cpu_loras=0)


def test_host_lru_evicts_the_least_recently_used_and_rereads_it(arch: ModelArch,
                                                                folders: dict[str, Path]) -> None:
    reg = LoraRegistry(SPEC, arch, max_cpu_loras=2)
    first = {n: reg.add(n, folders[n]) for n in "abc"}
    assert reg.in_host_memory() == ["b", "c"] and reg.host_evictions == 1 and reg.loads == 3
    assert reg.get("b") is first["b"]  # a hit: b is now the most recent
    assert reg.in_host_memory() == ["c", "b"] and reg.loads == 3
    again = reg.get("a")  # re-read from its folder, c dropped
    assert again is not first["a"] and reg.loads == 4 and reg.host_evictions == 2
    _same(again, first["a"])
    assert reg.in_host_memory() == ["b", "a"]
    assert reg.get_versioned("a") == (again, reg.version("a"))


def test_remove_and_add_again_with_another_folder(arch: ModelArch, folders: dict[str, Path]) -> None:
    reg = LoraRegistry(SPEC, arch, max_cpu_loras=2)
    reg.add("a", folders["a"])
    version = reg.version("a")
    reg.remove("a")
    assert "a" not in reg and reg.names() == [] and reg.unloads == 1 and reg.in_host_memory() == []
    with pytest.raises(LoraError, match=r"^lora_name: adapter 'a' is not loaded$"):
        reg.remove("a")
    with pytest.raises(KeyError):
        reg.get("a")
    reg.add("a", folders["b"])
    assert reg.version("a") != version and reg.path("a") == folders["b"]
    fresh = LoraRegistry(SPEC, arch, max_cpu_loras=1)
    _same(reg.get("a"), fresh.add("b", folders["b"]))


def test_a_folder_gone_before_a_reread_is_a_lora_error(arch: ModelArch, folders: dict[str, Path]) -> None:
    reg = LoraRegistry(SPEC, arch, max_cpu_loras=1)
    reg.add("a", folders["a"])
    reg.add("b", folders["b"])
    shutil.rmtree(folders["a"])
    with pytest.raises(LoraError, match=r"^lora_path: adapter 'a': .* is not a folder"):
        reg.get("a")
    assert reg.in_host_memory() == ["b"]


def test_concurrent_adds_of_one_name_keep_one(arch: ModelArch, folders: dict[str, Path]) -> None:
    reg = LoraRegistry(SPEC, arch, max_cpu_loras=4)
    errors: list[Exception] = []

    def add(folder: Path) -> None:
        try:
            reg.add("x", folder)
        except LoraError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=add, args=(folders[n],)) for n in "abcd"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reg.names() == ["x"] and len(errors) == 3 and reg.loads == 1
