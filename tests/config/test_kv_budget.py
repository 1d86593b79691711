"""The KV budget (``executor.kv_cache_memory``): what the slot executors reserve is capped by it;
for the paged ones (ONNX Runtime's paged form, torch) it is the block pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.graph import build_graph
from inferflow.models.config import parse_model_config
from inferflow.runtimes.ort_ops.build import op_status
from inferflow.scheduling.kv_budget import (
    MIN_PAGED_AUTO_BYTES,
    KVBudget,
    kv_bytes_per_token,
    parse_memory,
    weights_bytes,
)

pytestmark = pytest.mark.usefixtures("config_env")


def graph_for(*overrides: str):
    return build_graph(compose_config(list(overrides)))


SLOTS = "executor.graph_form=gqa"  # ONNX Runtime on slots (the default pages where its op builds)
needs_op = pytest.mark.skipif(not op_status()[0], reason=f"paged-attention op: {op_status()[1]}")
PAGED = [pytest.param(("executor=onnxruntime", "executor.graph_form=paged"), marks=needs_op,
                      id="onnxruntime"), pytest.param(("executor=torch",), id="torch")]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("4GiB", 4 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("1073741824", 1024**3),
        (4096, 4096),
        ("auto", None),
        (None, None),
    ],
)
def test_sizes(text: object, size: int | None) -> None:
    assert parse_memory(text) == size  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["lots", "4 parsecs", "-1GiB", "0"])
def test_bad_sizes_name_the_key(bad: str) -> None:
    with pytest.raises(ValueError, match=r"executor\.kv_cache_memory"):
        parse_memory(bad)


def test_the_slots_and_the_pool_fit_the_budget() -> None:
    budget = KVBudget(64 * 1024**2, 4096, "test")  # 16,384 tokens
    for slots, block, blocks in ((16, 16, 0), (4, 16, 0), (8, 32, 100), (1, 16, 0)):
        length = budget.max_model_len(slots, block, blocks)
        pool = blocks * block or slots * length
        assert length % block == 0
        assert (slots * length + pool) * budget.bytes_per_token <= budget.bytes


def test_a_small_budget_caps_the_served_context(tiny_checkpoint: Path) -> None:
    graph = graph_for(SLOTS, "executor.kv_cache_memory=32MiB")
    arch = parse_model_config(tiny_checkpoint / "config.json")
    per_token = kv_bytes_per_token(arch, 4)
    layout = graph.kv_layout()
    assert graph.max_model_len == layout.max_model_len < arch.max_position_embeddings
    reserved = layout.max_slots * layout.max_model_len + layout.num_blocks * layout.block_size
    assert reserved * per_token <= 32 * 1024**2
    note = graph.kv_budget_note()
    assert note is not None and "executor.kv_cache_memory=32MiB" in note
    assert f"serving max_model_len={graph.max_model_len}" in note


def test_fewer_slots_leave_room_for_a_longer_context(tiny_checkpoint: Path) -> None:
    many = graph_for(SLOTS, "executor.kv_cache_memory=32MiB", "batching.max_num_seqs=16")
    few = graph_for(SLOTS, "executor.kv_cache_memory=32MiB", "batching.max_num_seqs=2")
    assert few.max_model_len == 8 * many.max_model_len


@pytest.mark.parametrize("form", ["auto", "gqa"])
def test_the_default_budget_leaves_the_tiny_model_alone(tiny_checkpoint: Path, form: str) -> None:
    graph = graph_for(f"executor.graph_form={form}")
    assert (
        graph.max_model_len
        == parse_model_config(tiny_checkpoint / "config.json").max_position_embeddings
    )
    assert graph.kv_budget_note() is None


def test_a_budget_too_small_for_the_slots_is_one_config_error(tiny_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="holds 100 tokens") as info:
        graph_for(SLOTS, "executor.kv_cache_memory=400KiB").check_engine_settings()
    assert info.value.key == "executor.kv_cache_memory"


# -- the paged executors (ONNX Runtime's paged form, torch): the budget is the block pool ------


@pytest.mark.parametrize("executor", PAGED)
def test_a_paged_executor_turns_the_budget_into_blocks(tiny_checkpoint: Path,
                                                       executor: tuple[str, ...]) -> None:
    arch = parse_model_config(tiny_checkpoint / "config.json")
    per_token = kv_bytes_per_token(arch, 4)
    graph = graph_for(*executor, "executor.kv_cache_memory=32MiB", "batching.max_num_seqs=200")
    layout = graph.kv_layout()
    assert layout.paged and layout.max_slots == 200  # rows, not reservations
    assert layout.num_blocks == 32 * 1024**2 // (per_token * layout.block_size)
    # one sequence may use the whole pool; more sequences do not shorten the context
    assert layout.max_model_len == min(arch.max_position_embeddings,
                                       layout.num_blocks * layout.block_size)
    assert graph.kv_budget_note() is None or "whole paged KV pool" in graph.kv_budget_note()


@pytest.mark.parametrize("executor", PAGED)
def test_a_paged_pool_smaller_than_the_context_says_so(tiny_checkpoint: Path,
                                                       executor: tuple[str, ...]) -> None:
    graph = graph_for(*executor, "executor.kv_cache_memory=256KiB")
    assert graph.max_model_len == graph.kv_layout().num_blocks * 16 < 2048
    note = graph.kv_budget_note()
    assert note is not None and "whole paged KV pool" in note and "256KiB" in note


def test_auto_paged_budget_stops_at_twice_what_the_sequences_need() -> None:
    layout = graph_for("executor=torch", "batching.max_num_seqs=4").kv_layout()
    assert layout.num_blocks <= 2 * 4 * -(-layout.max_model_len // layout.block_size)


@pytest.mark.parametrize("executor", PAGED)
def test_cache_num_blocks_wins_over_the_paged_budget(executor: tuple[str, ...]) -> None:
    layout = graph_for(*executor, "cache.num_blocks=100").kv_layout()
    assert layout.num_blocks == 100 and layout.paged


@needs_op
def test_the_cpu_engine_pages_by_default_with_a_pool_sized_from_the_model(
    tiny_checkpoint: Path,
) -> None:
    """``graph_form=auto`` pages where the op builds; ``auto`` KV is twice the weights, at least
    64 MiB (made resident at load: a small model gets a small pool), not half the machine."""
    graph = graph_for()
    layout, budget = graph.kv_layout(), graph.served_context.budget
    assert layout.paged and budget is not None and budget.auto
    weights = weights_bytes(tiny_checkpoint.glob("*.safetensors"))
    assert budget.bytes == max(MIN_PAGED_AUTO_BYTES, 2 * weights)
    assert layout.num_blocks * layout.block_size == budget.tokens
    assert "twice the weights" in budget.source
    assert graph.to_container()["executor"]["graph_form"] == "paged"  # pinned for the workers


def test_a_forced_fallback_serves_on_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the op cannot be built (forced here), ``auto`` is the slot form."""
    monkeypatch.setenv("INFERFLOW_ORT_OP", "off")
    graph = graph_for()
    assert not graph.kv_layout().paged
    assert graph.to_container()["executor"]["graph_form"] == "gqa"
    (note,) = graph.notes()  # the one line a start logs (task=check: a note)
    assert note.startswith("paged KV off") and "INFERFLOW_ORT_OP=off" in note
    assert graph_for("executor.graph_form=gqa").notes() == []  # chosen, not fallen back to
    with pytest.raises(ConfigError, match="graph_form: paged needs the paged-attention op"):
        graph_for("executor.graph_form=paged").check_engine_settings()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("executor.kv_cache_memory=0.5", "fraction of GPU memory needs device=cuda"),
        ("executor.kv_cache_memory=1.5", r"must be in \(0, 1\]"),
        ("executor.device=tpu", "must be cpu, cuda or cuda:N"),
        ("executor.threads=-1", "threads"),
    ],
)
def test_bad_torch_executor_settings_name_the_key(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        graph_for("executor=torch", override)
