"""``models:`` composes into one serving-graph config per entry (``inferflow.graph.repository``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cfg_helpers import run_cli

from inferflow.cli import compose_config
from inferflow.config import ConfigError, LoadMode
from inferflow.config.server import ServerConfig
from inferflow.graph.repository import embedding_entries, llm_entries, repository_entries
from inferflow.scheduling.kv_budget import KVBudget, auto_share, parse_memory

pytestmark = pytest.mark.server


def test_without_models_the_top_level_model_is_the_only_entry() -> None:
    entries = repository_entries(compose_config([]))
    assert [(e.key, e.load) for e in entries] == [("", LoadMode.eager)]
    assert entries[0].config["model"]["builtin"] == "tiny_llama"


def test_entries_inherit_slots_and_merge_their_overrides() -> None:
    cfg = compose_config([
        "+models.a.model.builtin=tiny_llama",
        "+models.a.model.name=a",
        "+models.b.model.builtin=tiny_llama",
        "+models.b.model.name=b",
        "+models.b.model.version=2",
        "+models.b.load=on_demand",
        "+models.b.executor.precision=int8",
        "+models.b.batching.max_num_seqs=4",
    ])
    a, b = llm_entries(cfg)
    assert (a.key, a.load, b.load) == ("a", LoadMode.eager, LoadMode.on_demand)
    assert a.config["executor"]["precision"] == "fp32"
    assert b.config["executor"]["precision"] == "int8"
    assert b.config["executor"]["_target_"] == a.config["executor"]["_target_"]
    assert b.config["batching"]["max_num_seqs"] == 4
    assert a.config["batching"]["max_num_seqs"] == cfg.batching.max_num_seqs
    assert "models" not in a.config and b.config["model"]["version"] == "2"
    # two LLMs share the machine: each engine's automatic KV budget is half of one alone
    assert a.config["executor"]["kv_cache_memory"] == "auto/2"


def test_every_slot_an_entry_names_is_merged_speculative_too() -> None:
    """An entry's slot override reaches its graph for every slot ModelEntryConfig accepts (a
    ``speculative:`` key used to pass validation and be dropped)."""
    import dataclasses

    from inferflow.config import SLOTS, ModelEntryConfig
    from inferflow.graph import build_entry_graph
    from inferflow.stages.speculative import NgramSpeculation, NoSpeculation

    assert set(SLOTS) <= {f.name for f in dataclasses.fields(ModelEntryConfig)}
    cfg = compose_config([
        "speculative=ngram",
        "+models.a.model.builtin=tiny_llama",
        "+models.a.speculative.num_speculative_tokens=2",
        "+models.b.model.builtin=tiny_llama",
        "+models.b.model.version=2",
        "+models.b.speculative._target_=inferflow.stages.speculative.NoSpeculation",
    ])
    a, b = llm_entries(cfg)
    assert a.config["speculative"]["_target_"].endswith("NgramSpeculation")
    assert a.config["speculative"]["num_speculative_tokens"] == 2
    assert b.config["speculative"] == {"_target_": "inferflow.stages.speculative.NoSpeculation"}
    graph_a, graph_b = build_entry_graph(a), build_entry_graph(b)  # ... and reaches each graph
    assert isinstance(graph_a.speculative, NgramSpeculation)
    assert graph_a.speculative.num_speculative_tokens == 2
    assert isinstance(graph_b.speculative, NoSpeculation)


def test_an_entry_without_model_serves_the_top_level_model() -> None:
    (entry,) = llm_entries(compose_config(["+models.main.load=eager"]))
    assert entry.config["model"]["builtin"] == "tiny_llama"


def test_embedding_entries_join_the_encoders() -> None:
    cfg = compose_config([
        "+models.chat.model.builtin=tiny_llama",
        "+models.enc.model.builtin=minilm",
        "+models.enc.model.task=embed",
    ])
    assert [e.key for e in llm_entries(cfg)] == ["chat"]
    assert [m.builtin for m in embedding_entries(cfg)] == ["minilm"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["+models.x.load=sometimes"], "models.x.load"),
        (["+models.x.bogus=1"], "models.x.bogus"),
        (["+models.x.model.builtin=minilm", "+models.x.model.task=embed",
          "+models.x.load=on_demand"], "models.x.load"),
        (["+models.x.model.name=m", "+models.y.model.name=m"], "models.y.model.version"),
    ],
)
def test_bad_entries_fail_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        repository_entries(compose_config(overrides))
    assert err.value.key == key, str(err.value)


def test_memory_sizes_and_the_auto_share() -> None:
    assert ServerConfig(model_memory_budget="2GiB").model_memory_budget_bytes == 2 * 2**30
    assert ServerConfig().model_memory_budget_bytes is None
    with pytest.raises(ValueError, match="model_memory_budget"):
        ServerConfig(model_memory_budget="lots")
    assert auto_share("auto") == 1 and auto_share("auto/3") == 3 and auto_share("1GiB") is None
    assert parse_memory("auto/3") is None
    whole = KVBudget.resolve("auto", 1024, 0)
    third = KVBudget.resolve("auto/3", 1024, 0)
    assert third.auto and third.bytes == pytest.approx(whole.bytes / 3, rel=0.01)


def _reserved_kv_tokens(args: list[str], env: dict[str, str], cwd: Path) -> list[int]:
    """Each LLM's reserved KV tokens as ``task=check`` prints them (its ``kv:`` line): the slots
    at full length plus the pool, or the paged pool."""
    proc = run_cli([*args, "task=check"], env, cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reserved = []
    for line in (x.strip() for x in proc.stdout.splitlines() if x.strip().startswith("kv:")):
        slots = re.search(r"(\d+) slots x (\d+) positions", line)
        pool = re.search(r"(\d+) blocks x (\d+) tokens", line)
        assert pool is not None, line
        reserved.append(int(pool[1]) * int(pool[2])
                        + (int(slots[1]) * int(slots[2]) if slots else 0))
    return reserved


@pytest.mark.slow  # builds three engines
@pytest.mark.parametrize("executor", ["onnxruntime", "torch"])
def test_two_llms_at_auto_each_reserve_half_of_what_one_alone_does(
    executor: str, cli_env: dict[str, str], workdir: Path
) -> None:
    """docs/models.md: with N LLMs, ``auto`` is ``auto/N``, an N-th of one engine alone (the
    default layout, not only the memory ceiling: on slots 8,192 blocks alone, 4,096 each of two;
    ONNX Runtime's paged pool: 64 MiB alone, 32 MiB each)."""
    if executor == "torch":
        pytest.importorskip("torch")
    (alone,) = _reserved_kv_tokens([f"executor={executor}"], cli_env, workdir)
    two = _reserved_kv_tokens([
        f"executor={executor}",
        "+models.a.model.builtin=tiny_llama", "+models.a.model.name=a",
        "+models.b.model.builtin=tiny_llama", "+models.b.model.name=b",
    ], cli_env, workdir)
    assert two == [alone // 2, alone // 2], (alone, two)
