"""The engine assembled from the graph's engine-side stages, in process: the cache stage really
decides prefix reuse, stream_interval shapes the deltas, the executor stage names the backend,
and response stages sit after the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest

from inferflow.cli import compose_config
from inferflow.config import ConfigError
from inferflow.engine.llm_engine import LLMEngine
from inferflow.graph import build_graph
from inferflow.sampling_params import SamplingParams
from inferflow.server.http.response_pipeline import ResponsePipeline
from inferflow.server.messages import ErrorInfo, RequestUpdate
from inferflow.server.worker.service import describe_engine
from inferflow.stages.base import StageError, StageRequest
from inferflow.stages.executor import OnnxRuntimeExecutor
from inferflow.stages.response import ResponseDelta, ResponseStage

pytestmark = [pytest.mark.server, pytest.mark.usefixtures("config_env")]
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


def _engine(*overrides: str) -> LLMEngine:
    return build_graph(compose_config(["model.max_model_len=256", *overrides])).create_engine()


def _run(engine: LLMEngine, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> list:
    engine.add_request(rid, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize(
    ("override", "reused"), [("cache=prefix", True), ("cache=none", False), ("~cache", False)]
)
def test_the_cache_stage_decides_prefix_reuse(override: str, reused: bool) -> None:
    engine = _engine(override)
    prompt = list(range(5, 5 + 40))  # two full blocks of 16, then 8 more
    first = _run(engine, "a", prompt)[-1]
    second = _run(engine, "b", prompt)[-1]
    assert first.metrics.num_cached_prompt_tokens == 0
    assert second.metrics.num_cached_prompt_tokens == (32 if reused else 0)
    assert (engine.stats().prefix_cache_hits > 0) is reused
    assert engine.describe()["scheduler"]["enable_prefix_caching"] is reused
    assert second.outputs[0].token_ids == first.outputs[0].token_ids  # same tokens either way


def test_stream_interval_emits_every_n_tokens_and_the_last() -> None:
    engine = _engine("detokenizer.stream_interval=3")
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    outputs = _run(engine, "a", [3, 4, 5], params)
    assert [len(o.outputs[0].delta_token_ids) for o in outputs] == [3, 3, 1]
    assert "".join(o.outputs[0].delta_text for o in outputs) == outputs[-1].outputs[0].text
    assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 7


@dataclass
class _RenamedBackend(OnnxRuntimeExecutor):
    backend: ClassVar[str] = "renamed"


def test_version_reports_the_executor_that_runs(tiny_checkpoint: Any) -> None:
    from inferflow.models.checkpoint import load_checkpoint
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.scheduler import Scheduler
    from inferflow.stages.batching import ContinuousBatching
    from inferflow.stages.detokenizer import StreamingDetokenizer

    layout = KVLayout.plan(2, 128)
    executor = _RenamedBackend()
    executor.load(load_checkpoint(tiny_checkpoint), layout)
    batching = ContinuousBatching(max_num_seqs=2)
    scheduler = Scheduler(batching, layout)
    engine = LLMEngine(
        load_checkpoint(tiny_checkpoint), executor, scheduler, StreamingDetokenizer()
    )
    info = describe_engine(engine, load_time_s=0.0)["engine"]
    assert info["backend"] == "renamed" and info["runtime_version"]
    assert info["layout"]["max_slots"] == 2 and info["scheduler"]["max_num_seqs"] == 2


def test_the_trace_resource_names_the_configured_backend() -> None:
    from inferflow.server.process.runtime import telemetry_settings

    graph = build_graph(compose_config(["executor=tensorrt"]))
    settings = telemetry_settings(graph, graph.to_container())  # TensorRT is never imported
    assert settings.engine == "tensorrt" and settings.engine_version is None  # not installed
    cpu = build_graph(compose_config([]))
    assert telemetry_settings(cpu, cpu.to_container()).engine == "onnxruntime"


def test_old_detokenizer_target_still_works_with_a_warning() -> None:
    old = "detokenizer._target_=inferflow.stages.detokenizer.IncrementalDetokenizer"
    with pytest.warns(FutureWarning, match="now StreamingDetokenizer"):
        graph = build_graph(compose_config([old]))
    assert type(graph.detokenizer).__name__ == "StreamingDetokenizer"


def test_stages_must_sit_on_their_side_of_the_engine() -> None:
    with pytest.raises(ConfigError, match=r"^stages\.passthrough: a RequestStage runs before"):
        build_graph(compose_config(["+stages=passthrough", "stages.passthrough.after=detokenizer"]))


class _Rejecting(ResponseStage):
    def process(self, delta: ResponseDelta, state: Any) -> ResponseDelta:
        if "x" in delta.text:
            raise StageError("output", "the answer may not contain x", status_code=422)
        return delta.with_text(delta.text + "!")


def test_a_response_stage_transforms_or_rejects_updates() -> None:
    run = ResponsePipeline([_Rejecting()]).open(StageRequest("r"))
    assert run is not None
    assert run.apply(RequestUpdate("r", text="ab")).text == "ab!"
    rejected = run.apply(RequestUpdate("r", text="xy"))
    assert rejected.text == "" and rejected.final and rejected.error is not None
    assert (rejected.error.status_code, rejected.error.param) == (422, "output")
    assert run.apply(RequestUpdate("r", text="zz")).text == "zz"  # done: passes through
    engine_error = ErrorInfo(504, "timeout")
    again = ResponsePipeline([_Rejecting()]).open(None)
    assert again is not None
    failed = again.apply(RequestUpdate("r", text="x", error=engine_error))
    assert failed.error is engine_error and failed.text == ""  # the engine's error wins
    assert ResponsePipeline([]).open(StageRequest("r")) is None  # no stages: no cost


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            # 1024 running rows > a 512-token step budget
            ["batching.max_num_seqs=1024", "batching.max_num_batched_tokens=512"],
            r"^batching\.max_num_batched_tokens: 512 < 1024 running sequences.*"
            r"raise batching\.max_num_batched_tokens",
        ),
        (
            ["batching.enable_chunked_prefill=false", "batching.max_num_batched_tokens=512"],
            r"^batching\.max_num_batched_tokens: must be >= max_model_len \(2048\) without chunked",
        ),
        (["batching=static", "batching.max_num_batched_tokens=4"], r"^batching\.max_num_batched"),
        (["executor=tensorrt"], r"^executor\.backend: TensorRT is not installed"),
        (["executor.max_slots=0"], r"^executor\.max_slots: must be >= 1"),
    ],
)
def test_engine_settings_the_worker_would_refuse_are_refused_up_front(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_graph(compose_config(overrides)).check_engine_settings()


def test_task_check_refuses_them_in_one_line(cli_env: dict[str, str], workdir: Any) -> None:
    from cfg_helpers import run_cli

    proc = run_cli(["batching.max_num_seqs=1024", "batching.max_num_batched_tokens=512",
                    "task=check"], cli_env, workdir)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "batching.max_num_batched_tokens" in proc.stderr
