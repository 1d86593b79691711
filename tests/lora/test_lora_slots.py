"""LoraSlots: a step's adapters made resident in the engine's slots (LRU among the slots no
adapter of the step, and no running request, needs), writes counted, stale versions never served."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lora_fixtures import small_arch

from inferflow.lora import LoraAdapter, LoraError, LoraSpec
from inferflow.lora.registry import LoraRegistry
from inferflow.lora.slots import LoraRunner, LoraSlots
from inferflow.models.config import ModelArch
from inferflow.testing.lora import write_lora_adapter


class RecordingRunner:
    """An engine that keeps what each slot holds and records every set_lora."""

    def __init__(self, spec: LoraSpec | None) -> None:
        self.lora_spec = spec
        self.held: list[LoraAdapter | None] = [None] * (spec.max_loras if spec else 0)
        self.calls: list[tuple[int, str | None]] = []

    def set_lora(self, slot: int, adapter: LoraAdapter | None) -> None:
        assert 0 <= slot < len(self.held)
        self.held[slot] = adapter
        self.calls.append((slot, adapter.name if adapter else None))


@pytest.fixture(scope="module")
def arch(tmp_path_factory: pytest.TempPathFactory) -> ModelArch:
    return small_arch(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, arch: ModelArch) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: write_lora_adapter(root / name, arch, rank=4, seed=seed)
            for seed, name in enumerate("abcdef")}


def _setup(arch: ModelArch, folders: dict[str, Path], slots: int = 2, names: str = "abcd",
           max_cpu: int = 8) -> tuple[RecordingRunner, LoraRegistry, LoraSlots]:
    spec = LoraSpec(max_loras=slots, max_lora_rank=8)
    runner, registry = RecordingRunner(spec), LoraRegistry(spec, arch, max_cpu)
    for n in names:
        registry.add(n, folders[n])
    runner_typed: LoraRunner = runner  # the Protocol: RecordingRunner satisfies it
    return runner, registry, LoraSlots(runner_typed, registry)


def test_an_engine_without_lora_is_refused(arch: ModelArch) -> None:
    with pytest.raises(ValueError, match="built without LoRA"):
        LoraSlots(RecordingRunner(None), LoraRegistry(LoraSpec(1, 8), arch, 1))


def test_resident_adapters_are_not_written_again(arch: ModelArch, folders: dict[str, Path]) -> None:
    runner, registry, slots = _setup(arch, folders)
    assert slots.assign({"a"}) == {"a": 0}
    assert slots.assign({"a", "b"}) == {"a": 0, "b": 1}
    assert slots.assign(["b", "a"]) == {"a": 0, "b": 1}
    assert slots.assign(set()) == {}
    assert runner.calls == [(0, "a"), (1, "b")] and slots.loads_into_engine == 2
    assert runner.held[0] is registry.get("a") and slots.resident() == {"a": 0, "b": 1}


def test_the_least_recently_used_slot_outside_the_step_is_reused(arch: ModelArch,
                                                                 folders: dict[str, Path]) -> None:
    runner, _, slots = _setup(arch, folders)
    slots.assign({"a"})
    slots.assign({"b"})
    slots.assign({"a"})  # b is now the least recently used
    assert slots.assign({"c"}) == {"c": 1}
    assert slots.assign({"c", "a"}) == {"a": 0, "c": 1}  # both resident: nothing written
    assert slots.assign({"a", "d"}) == {"a": 0, "d": 1}  # c evicted though used as late as a
    assert runner.calls == [(0, "a"), (1, "b"), (1, "c"), (1, "d")]
    with pytest.raises(ValueError, match=r"3 adapters in one step, the engine has 2 slots"):
        slots.assign({"a", "b", "c"})


def test_adapters_of_running_requests_are_evicted_last(arch: ModelArch, folders: dict[str, Path]) -> None:
    runner, _, slots = _setup(arch, folders, slots=3, names="abcde")
    slots.assign({"a", "b", "c"})
    slots.assign({"a"})
    slots.assign({"b"})  # LRU order now: c, a, b
    assert slots.assign({"d"}, running={"c"}) == {"d": 0}  # a, the LRU one not running
    assert slots.assign({"e"}, running={"b", "c", "d"}) == {"e": 2}  # c: all run, LRU of them
    assert runner.calls[-2:] == [(0, "d"), (2, "e")]


def test_an_evicted_adapter_reloads_from_host_memory(arch: ModelArch, folders: dict[str, Path]) -> None:
    runner, registry, slots = _setup(arch, folders, slots=1)
    a = registry.get("a")
    slots.assign({"a"})
    slots.assign({"b"})
    loads = registry.loads
    assert slots.assign({"a"}) == {"a": 0}
    assert registry.loads == loads and runner.held[0] is a and slots.loads_into_engine == 3


def test_an_adapter_gone_from_host_memory_is_reread(arch: ModelArch, folders: dict[str, Path]) -> None:
    runner, registry, slots = _setup(arch, folders, slots=1, names="abc", max_cpu=2)
    assert registry.in_host_memory() == ["b", "c"]
    loads = registry.loads
    slots.assign({"a"})
    assert registry.loads == loads + 1 and runner.held[0] is registry.get("a")


def test_an_unknown_adapter_is_a_lora_error_on_model(arch: ModelArch, folders: dict[str, Path]) -> None:
    runner, _, slots = _setup(arch, folders)
    with pytest.raises(LoraError, match=r"^model: adapter 'z' is not loaded$") as info:
        slots.assign({"z"})
    assert info.value.field == "model" and runner.calls == []


def test_a_removed_adapter_serves_its_running_requests_until_freed(arch: ModelArch,
                                                                  folders: dict[str, Path]) -> None:
    runner, registry, slots = _setup(arch, folders)
    slots.assign({"a", "b"})
    registry.remove("a")
    assert slots.assign({"a"}) == {"a": 0}  # still resident: its running requests finish
    slots.assign({"b"})
    assert slots.assign({"c"}, running={"a"}) == {"c": 1}  # a runs: b goes, though a is older
    slots.assign({"c"})
    assert slots.assign({"d"}) == {"d": 0}  # a, removed and not needed: the first to go
    with pytest.raises(LoraError, match="not loaded"):
        slots.assign({"a"})  # removed and no longer resident
    slots.free("d")
    assert runner.held[0] is None and runner.calls[-1] == (0, None) and slots.resident() == {"c": 1}
    assert slots.assign({"b"}) == {"b": 0}  # the freed slot


def test_a_name_added_again_never_serves_the_old_weights(arch: ModelArch, folders: dict[str, Path]) -> None:
    runner, registry, slots = _setup(arch, folders, slots=3)
    slots.assign({"a", "b", "c"})
    registry.remove("b")
    registry.add("b", folders["e"])
    assert slots.assign({"b"}) == {"b": 1}  # rewritten in place
    assert runner.held[1] is registry.get("b") and runner.held[1].path == folders["e"]
    slots.assign({"c"})  # c is the most recently used ...
    registry.remove("c")
    registry.add("c", folders["f"])
    assert slots.assign({"d"}) == {"d": 2}  # ... but its slot holds a stale copy: reused first
    assert slots.loads_into_engine == 5


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["assign", "assign", "remove", "add", "free"]),
                          st.sets(st.sampled_from("abcd"), max_size=3),
                          st.sets(st.sampled_from("abcd"), max_size=2),
                          st.sampled_from("abcd"), st.sampled_from("abcdef")), max_size=40),
       st.integers(1, 3))
def test_random_operations_keep_every_served_adapter_current(
        arch: ModelArch, folders: dict[str, Path],
        ops: list[tuple[str, set[str], set[str], str, str]], num_slots: int) -> None:
    runner, registry, slots = _setup(arch, folders, slots=num_slots, names="abc", max_cpu=2)
    written: dict[int, tuple[str, int | None]] = {}  # slot -> (name, its version when written)
    for op, names, running, one, folder in ops:
        if op == "remove" and one in registry:
            registry.remove(one)
        elif op == "add" and one not in registry:
            registry.add(one, folders[folder])
        elif op == "free":
            slots.free(one)
            written = {s: nv for s, nv in written.items() if nv[0] != one}
        elif op == "assign":
            names = {n for n in names if n in registry}
            if len(names) > num_slots:
                continue
            current = {nv[0]: s for s, nv in written.items() if nv[1] == registry.version(nv[0])}
            calls = len(runner.calls)
            got = slots.assign(names, running)
            assert set(got) == names and len(set(got.values())) == len(names)
            # exactly the adapters not current in a slot were written, nothing else moved
            assert len(runner.calls) - calls == len(names - set(current))
            for name, slot in got.items():
                if name in current:
                    assert slot == current[name]
                held = runner.held[slot]
                assert held is not None and held.name == name and held.path == registry.path(name)
            for slot, _ in runner.calls[calls:]:
                written[slot] = (runner.held[slot].name, registry.version(runner.held[slot].name))  # type: ignore[union-attr]
        assert {s for s, h in enumerate(runner.held) if h is not None} == set(written)
