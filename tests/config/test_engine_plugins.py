"""Engine-side and response-side plugins as users write them (plugins/engine_examples), on a live
``python -m inferflow`` server driven by the ``openai`` client: from a folder outside the package
(``INFERFLOW_CONFIG_PATH``) and pip-installed (entry point ``inferflow.plugins``)."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from cfg_helpers import PLUGINS, REPO, pip_install_copy, run_cli

from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.config import SchedulerConfig
from inferflow.scheduling.plan import ExecutorOutput, SampledToken
from inferflow.scheduling.request import Request
from inferflow.scheduling.scheduler import Scheduler

EXAMPLES = PLUGINS / "engine_examples"
EXAMPLES_CONF = EXAMPLES / "inferflow_examples" / "conf"
sys.path.insert(0, str(REPO / "tests" / "server"))
from server_harness import ServerProcess  # noqa: E402

PLUGIN_OVERRIDES = [
    "batching=shortest_first",
    "batching.max_num_seqs=1",
    "executor=step_counter",
    "+stages=shout",
]


def _examples():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import inferflow_examples
    finally:
        sys.path.remove(str(EXAMPLES))
    return inferflow_examples


def _admission_order(policy: object) -> list[str]:
    """Request ids in the order a one-slot scheduler admits them, all queued at once."""
    config = SchedulerConfig(max_num_seqs=1, max_slots=1, max_model_len=64, num_blocks=16)
    scheduler = Scheduler(config, policy=policy)
    for rid, n in [("long", 20), ("mid", 10), ("short", 3)]:
        scheduler.add_request(Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1)))
    order = []
    while scheduler.has_unfinished_requests():
        plan = scheduler.schedule()
        order += [c.request_id for c in plan.chunks if c.request_id not in order]
        sampled = {c.request_id: SampledToken(5) for c in plan.chunks if c.sample}
        scheduler.update(plan, ExecutorOutput(sampled))
    return order


def test_a_plugin_policy_reorders_admission_without_touching_the_scheduler() -> None:
    assert _admission_order(None) == ["long", "mid", "short"]  # fcfs
    assert _admission_order(_examples().ShortestPromptFirst()) == ["short", "mid", "long"]


@pytest.fixture(scope="module")
def folder_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {
        "INFERFLOW_CONFIG_PATH": str(EXAMPLES_CONF),
        "INFERFLOW_ALLOWED_TARGETS": "inferflow_examples",
        "PYTHONPATH": os.pathsep.join([str(REPO), str(EXAMPLES)]),
    }
    server = ServerProcess(PLUGIN_OVERRIDES, tmp_path_factory.mktemp("examples"), env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.terminate()


def _complete(server: ServerProcess, prompt: str | list[int], **kwargs: object) -> str:
    out = server.client().completions.create(model="tiny-llama", prompt=prompt, **kwargs)
    return out.choices[0].text


@pytest.mark.slow
def test_plugin_executor_is_selected_and_serves(folder_server: ServerProcess) -> None:
    engine = folder_server.get("/version").json()["engine"]
    assert engine["backend"] == "step_counter" and engine["wraps"] == "onnxruntime"
    assert _complete(folder_server, "Hello", max_tokens=4, temperature=0)
    steps = folder_server.stats()["engine"]["executor"]
    assert steps["steps"] >= 4 and steps["rows"] >= steps["steps"]  # counted in the worker


@pytest.mark.slow
def test_plugin_response_stage_transforms_streamed_and_plain_text_alike(
    folder_server: ServerProcess, tiny_checkpoint: Path
) -> None:
    from inferflow import LLM

    args = {"max_tokens": 24, "temperature": 0, "extra_body": {"ignore_eos": True}}
    plain = _complete(folder_server, "The weather today", **args)
    chunks = folder_server.client().completions.create(
        model="tiny-llama", prompt="The weather today", stream=True, **args
    )
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    reference = LLM(tiny_checkpoint, max_slots=1).generate(
        "The weather today", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    )
    raw = reference[0].outputs[0].text
    assert raw != raw.upper()  # the model's own text has lower-case letters ...
    assert plain == streamed == raw.upper()  # ... which the stage upper-cases, both ways


@pytest.mark.slow
def test_plugin_policy_orders_queued_requests_on_a_live_server(
    folder_server: ServerProcess,
) -> None:
    """One slot: while a long request runs, a long and a short prompt queue (long first); the
    shortest-first policy finishes the short one first (order of completion, not wall time)."""
    finished: list[str] = []
    lock = threading.Lock()

    def run(name: str, prompt: list[int], max_tokens: int) -> None:
        _complete(
            folder_server,
            prompt,
            max_tokens=max_tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        with lock:
            finished.append(name)

    blocker = threading.Thread(target=run, args=("blocker", [5] * 8, 1500))
    blocker.start()
    folder_server.wait_until(lambda s: s["engine"]["running"] == 1, what="the blocker running")
    threads = [threading.Thread(target=run, args=("long", [7] * 300, 4))]
    threads[0].start()
    folder_server.wait_until(lambda s: s["engine"]["waiting"] == 1, what="long queued")
    threads.append(threading.Thread(target=run, args=("short", [9] * 3, 4)))
    threads[1].start()
    stats = folder_server.wait_until(lambda s: s["engine"]["waiting"] == 2, what="both queued")
    assert stats["engine"]["running"] == 1  # the blocker still runs: both really wait
    for t in [blocker, *threads]:
        t.join(timeout=120)
    assert finished == ["blocker", "short", "long"]


def test_a_plugin_target_that_is_not_trusted_is_refused_in_one_line(
    cli_env: dict[str, str], workdir: Path
) -> None:
    env = {
        **cli_env,
        "INFERFLOW_CONFIG_PATH": str(EXAMPLES_CONF),
        "PYTHONPATH": os.pathsep.join([str(REPO), str(EXAMPLES)]),
    }
    proc = run_cli(["task=check", "executor=step_counter"], env, workdir)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "inferflow: executor._target_=inferflow_examples.StepCountingExecutor is not allowed"
    )


@pytest.fixture(scope="module")
def installed_examples(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """plugins/engine_examples pip-installed into a private site folder."""
    site = pip_install_copy(EXAMPLES, tmp_path_factory.mktemp("examples_install"))
    return site


@pytest.mark.slow
def test_installed_plugin_serves_every_slot(
    installed_examples: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), str(installed_examples)])}
    server = ServerProcess(PLUGIN_OVERRIDES, tmp_path_factory.mktemp("installed"), env)
    try:
        server.wait_ready()
        assert server.get("/version").json()["engine"]["backend"] == "step_counter"
        text = _complete(server, "Hi", max_tokens=8, temperature=0)
        assert text and text == text.upper()
        body = {"model": "tiny-llama", "prompt": "Hi", "max_tokens": 8, "temperature": 0}
        assert (
            httpx.post(server.url("/v1/completions"), json=body, timeout=60).json()["choices"][0][
                "text"
            ]
            == text
        )
        assert server.stats()["engine"]["executor"]["steps"] >= 8
    finally:
        server.terminate()
