"""The KV budget (``executor.kv_cache_memory``) caps what the slot executors reserve."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.graph import build_graph
from inferflow.models.config import parse_model_config
from inferflow.scheduling.kv_budget import KVBudget, kv_bytes_per_token, parse_memory

pytestmark = pytest.mark.usefixtures("config_env")


def graph_for(*overrides: str):
    return build_graph(compose_config(list(overrides)))


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
    graph = graph_for("executor.kv_cache_memory=32MiB")
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
    many = graph_for("executor.kv_cache_memory=32MiB", "batching.max_num_seqs=16")
    few = graph_for("executor.kv_cache_memory=32MiB", "batching.max_num_seqs=2")
    assert few.max_model_len == 8 * many.max_model_len


def test_the_default_budget_leaves_the_tiny_model_alone(tiny_checkpoint: Path) -> None:
    graph = graph_for()
    assert (
        graph.max_model_len
        == parse_model_config(tiny_checkpoint / "config.json").max_position_embeddings
    )
    assert graph.kv_budget_note() is None


def test_a_budget_too_small_for_the_slots_is_one_config_error(tiny_checkpoint: Path) -> None:
    with pytest.raises(ConfigError, match="holds 100 tokens") as info:
        graph_for("executor.kv_cache_memory=400KiB").check_engine_settings()
    assert info.value.key == "executor.kv_cache_memory"


# -- the paged executor (executor=torch): the budget is the block pool -------------------------


def test_a_paged_executor_turns_the_budget_into_blocks(tiny_checkpoint: Path) -> None:
    arch = parse_model_config(tiny_checkpoint / "config.json")
    per_token = kv_bytes_per_token(arch, 4)
    graph = graph_for("executor=torch", "executor.kv_cache_memory=32MiB",
                      "batching.max_num_seqs=200")
    layout = graph.kv_layout()
    assert layout.paged and layout.max_slots == 200  # rows, not reservations
    assert layout.num_blocks == 32 * 1024**2 // (per_token * layout.block_size)
    # one sequence may use the whole pool; more sequences do not shorten the context
    assert layout.max_model_len == min(arch.max_position_embeddings,
                                       layout.num_blocks * layout.block_size)
    assert graph.kv_budget_note() is None or "whole paged KV pool" in graph.kv_budget_note()


def test_a_paged_pool_smaller_than_the_context_says_so(tiny_checkpoint: Path) -> None:
    graph = graph_for("executor=torch", "executor.kv_cache_memory=256KiB")
    assert graph.max_model_len == graph.kv_layout().num_blocks * 16 < 2048
    note = graph.kv_budget_note()
    assert note is not None and "whole paged KV pool" in note and "256KiB" in note


def test_auto_paged_budget_stops_at_twice_what_the_sequences_need() -> None:
    layout = graph_for("executor=torch", "batching.max_num_seqs=4").kv_layout()
    assert layout.num_blocks <= 2 * 4 * -(-layout.max_model_len // layout.block_size)


def test_cache_num_blocks_wins_over_the_paged_budget() -> None:
    layout = graph_for("executor=torch", "cache.num_blocks=100").kv_layout()
    assert layout.num_blocks == 100 and layout.paged


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
