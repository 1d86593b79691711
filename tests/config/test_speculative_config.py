"""The ``speculative`` slot from the command line to the engine's scheduler."""

from __future__ import annotations

import pytest

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.graph import build_graph
from inferflow.stages.speculative import NgramProposer, NgramSpeculation, NoSpeculation

pytestmark = pytest.mark.usefixtures("config_env")


def graph_for(*overrides: str):
    return build_graph(compose_config(["model.max_model_len=256", *overrides]))


def test_default_is_no_speculation() -> None:
    graph = graph_for()
    assert isinstance(graph.speculative, NoSpeculation) and graph.speculative.proposer() is None
    engine = graph.create_engine()
    assert engine.scheduler.drafts is None
    assert engine.describe()["speculative"] == {"enabled": False}


def test_ngram_settings_reach_the_scheduler() -> None:
    graph = graph_for("speculative=ngram", "speculative.num_speculative_tokens=3",
                      "speculative.prompt_lookup_min=2", "speculative.prompt_lookup_max=5")
    assert graph.speculative == NgramSpeculation(3, 2, 5)
    engine = graph.create_engine()
    assert engine.scheduler.drafts is not None
    proposer = engine.scheduler.drafts.proposer
    assert isinstance(proposer, NgramProposer)
    assert (proposer.num_speculative_tokens, proposer.prompt_lookup_min,
            proposer.prompt_lookup_max) == (3, 2, 5)
    assert engine.describe()["speculative"] == {
        "enabled": True, "proposer": "NgramProposer", "num_speculative_tokens": 3,
        "prompt_lookup_min": 2, "prompt_lookup_max": 5}


@pytest.mark.parametrize(("overrides", "message"), [
    (["speculative.num_speculative_tokens=0"], r"^speculative\.num_speculative_tokens: must be >= 1"),
    (["speculative.prompt_lookup_min=6"], r"^speculative\.prompt_lookup_min: must be in \[1, "),
    (["+speculative.bogus=1"], r"^speculative\.bogus"),
])
def test_bad_settings_name_the_key(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        graph_for("speculative=ngram", *overrides)


def test_an_executor_that_cannot_verify_drafts_refuses_speculation() -> None:
    with pytest.raises(ConfigError, match=r"^speculative: the tensorrt executor does not verify"):
        graph_for("speculative=ngram", "executor=tensorrt").check_engine_settings()


def test_a_pipeline_list_without_the_slot_still_gets_it() -> None:
    """Configs written before the slot existed list the old pipeline; speculation still applies."""
    old = "pipeline=[validator,tokenizer,cache,batching,guided,executor,detokenizer]"
    assert isinstance(graph_for(old, "speculative=ngram").speculative, NgramSpeculation)
    assert isinstance(graph_for("~speculative").speculative, NoSpeculation)
