"""Speculative decoding through a live server and the ``openai`` client: a server started with
``speculative=ngram speculative.num_speculative_tokens=4`` answers exactly what the default
server answers (greedy; prefix cache on; alone and in a continuous batch with other requests),
and reports its drafts in ``/metrics`` and on the engine-step spans."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from server_harness import MODEL, ServerProcess, start_server, trace_spans
from test_server_telemetry import metric_value

pytestmark = [pytest.mark.server, pytest.mark.slow]

REPETITIVE = [
    ".. function:: open(file, mode='r')\n\n   Open *file* and return a file object.\n\n"
    ".. function:: open(",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
    "The list, the list, the list, the list",
]
PLAIN = ["The Python tutorial", "Exceptions are raised when"]


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    traces = tmp_path_factory.mktemp("spec_traces") / "traces.jsonl"
    srv = start_server(tmp_path_factory, "spec", [
        "speculative=ngram", "speculative.num_speculative_tokens=4",
        "tracing=file", f"tracing.file_path={traces}"])
    srv.traces_path = traces  # type: ignore[attr-defined]
    yield srv
    srv.terminate()


def complete(server: ServerProcess, prompt: str, **kw: object) -> tuple[str, list[str], int]:
    """(text, token strings, completion tokens) of one greedy completion."""
    out = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                             temperature=0, **kw)  # type: ignore[arg-type]
    choice = out.choices[0]
    tokens = choice.logprobs.tokens if choice.logprobs is not None else []
    assert out.usage is not None
    return choice.text, list(tokens or []), out.usage.completion_tokens


def test_greedy_answers_equal_the_plain_server_alone_and_batched(
    spec_server: ServerProcess, default_server: ServerProcess
) -> None:
    prompts = REPETITIVE + PLAIN
    for kw in ({}, {"logprobs": 1}):  # plain rows, and the per-position path with logprobs
        want = [complete(default_server, p, **kw) for p in prompts]
        alone = [complete(spec_server, p, **kw) for p in prompts]
        with ThreadPoolExecutor(8) as pool:  # a continuous batch, with sampled requests beside
            others = [pool.submit(spec_server.client().completions.create, model=MODEL,
                                  prompt=p, max_tokens=24, temperature=1.0, seed=i)
                      for i, p in enumerate(prompts)]
            batched = list(pool.map(lambda p, kw=kw: complete(spec_server, p, **kw), prompts))
            assert all(f.result().choices[0].finish_reason in ('stop', 'length') for f in others)
        assert alone == want and batched == want
        if kw:
            assert all(len(tokens) == n for _, tokens, n in want)


def test_streaming_equals_the_plain_server(
    spec_server: ServerProcess, default_server: ServerProcess
) -> None:
    def stream(server: ServerProcess, prompt: str) -> str:
        chunks = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=40,
                                                    temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    for prompt in REPETITIVE[:2]:
        assert stream(spec_server, prompt) == stream(default_server, prompt)
        stop = stream(default_server, prompt)[10:14]
        kw = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "stop": [stop]}
        assert (spec_server.client().completions.create(**kw).choices[0].text  # type: ignore[call-overload]
                == default_server.client().completions.create(**kw).choices[0].text)  # type: ignore[call-overload]


def test_drafts_are_reported_in_metrics_and_step_spans(spec_server: ServerProcess) -> None:
    for prompt in REPETITIVE:
        complete(spec_server, prompt)
    text = spec_server.get("/metrics").text
    drafts = metric_value(text, "vllm:spec_decode_num_drafts_total")
    proposed = metric_value(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_value(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted < proposed <= 4 * drafts
    rate = metric_value(text, "vllm:spec_decode_draft_acceptance_rate")
    assert rate == pytest.approx(accepted / proposed, rel=1e-6)
    assert metric_value(text, "inferflow:spec_decode_mean_accepted_length") == pytest.approx(
        1 + accepted / drafts, rel=1e-6)
    assert metric_value(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                        position="0") > 0
    path: Path = spec_server.traces_path  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while True:
        steps = [attrs for s in trace_spans(path) if s["name"] == "engine step"
                 and "inferflow.spec_decode.num_draft_tokens" in (attrs := _attrs(s))]
        if steps or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert steps, "no engine-step span carries spec_decode attributes"
    assert all(a["inferflow.spec_decode.num_accepted_tokens"]
               <= a["inferflow.spec_decode.num_draft_tokens"] for a in steps)


def _attrs(span: dict) -> dict[str, int]:
    return {a["key"]: int(a["value"].get("intValue", 0)) for a in span.get("attributes", ())
            if "intValue" in a["value"]}
