"""Prompt logprobs (``SamplingParams.prompt_logprobs``) and ``max_tokens=0`` against
transformers' log-softmax of the same checkpoint: the slot layout (ONNX Runtime, both graph
forms) and the paged one (torch), with chunked prefill and the prefix cache on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_factories import ORT_FORMS, llm_on, make_named_checkpoint

from inferflow import LLM, SamplingParams
from inferflow.engine.llm_engine import RequestRejected
from inferflow.outputs import RequestOutput, TokenLogprob
from inferflow.sampling_params import RequestOutputKind

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BLOCK = 8
TEXTS = ["Once upon a time there was a robot who lived in a small house by the sea, and",
         "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_named_checkpoint(tmp_path_factory.mktemp("prompt_logprobs"), "gqa8x2")


@pytest.fixture(scope="module", params=[*ORT_FORMS, "canonical", "torch"])
def llm(request: pytest.FixtureRequest, path: Path) -> LLM:
    """Chunks of 8 tokens a step (chunked prefill), blocks of 8, the prefix cache on."""
    return llm_on(path, request.param, max_num_seqs=4, max_num_batched_tokens=8,
                  block_size=BLOCK, enable_prefix_caching=True, max_model_len=128)


def reference(path: Path, prompt: list[int]) -> np.ndarray:
    """transformers' float64 log-softmax of every prompt position's logits: (P, V)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def check_against(got: list[TokenLogprob | None], prompt: list[int], ref: np.ndarray,
                  k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        assert entry is not None and entry.token_id == prompt[i]
        assert abs(entry.logprob - ref[i - 1, prompt[i]]) < 1e-4, i
        want = np.argsort(-ref[i - 1], kind="stable")[:k]
        assert len(entry.top) == k
        # the top-k values agree; ids agree except between near-ties
        np.testing.assert_allclose([p for _, p in entry.top], ref[i - 1, want], atol=1e-4)
        for t, p in entry.top:
            assert abs(p - ref[i - 1, t]) < 1e-4


def test_prompt_logprobs_equal_transformers_with_chunks_and_cache(llm: LLM, path: Path) -> None:
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    assert all(len(p) > 2 * BLOCK + 1 for p in prompts)  # several chunks, several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=3)
    first = llm.generate(prompts, params)  # together: chunks of both in one step
    again = llm.generate(prompts, params)  # their blocks are cached now: no hits for these
    plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3))
    for prompt, a, b, c in zip(prompts, first, again, plain, strict=True):
        assert a.prompt_logprobs is not None
        check_against(a.prompt_logprobs, prompt, reference(path, prompt), 3)
        assert b.prompt_logprobs == a.prompt_logprobs
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.metrics is not None and b.metrics is not None and c.metrics is not None
        assert a.metrics.num_cached_prompt_tokens == b.metrics.num_cached_prompt_tokens == 0
        # ... but they were cached for others: a request without prompt logprobs hits them
        assert c.metrics.num_cached_prompt_tokens == (len(prompt) - 1) // BLOCK * BLOCK
        assert c.prompt_logprobs is None and a.outputs[0].logprobs is None
    assert llm.engine.scheduler.stats.num_kv_blocks_used == 0


def test_prompt_logprobs_zero_gives_the_tokens_logprob_only(llm: LLM, path: Path) -> None:
    prompt = llm.tokenizer.encode(TEXTS[1])
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    assert out[0].prompt_logprobs is not None
    check_against(out[0].prompt_logprobs, prompt, reference(path, prompt), 0)


def test_max_tokens_zero_computes_the_prompt_only(llm: LLM, path: Path) -> None:
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    steps_before = llm.engine.scheduler.stats.num_scheduled_tokens
    outs = llm.generate(prompts, [SamplingParams(max_tokens=0, prompt_logprobs=1),
                                  SamplingParams(max_tokens=0)])
    for out in outs:
        completion = out.outputs[0]
        assert out.finished and completion.finish_reason == "length"
        assert completion.token_ids == [] and completion.text == ""
    assert outs[1].prompt_logprobs is None and outs[0].prompt_logprobs is not None
    check_against(outs[0].prompt_logprobs, prompts[0], reference(path, prompts[0]), 1)
    # the prompts were computed (the second one maybe from cached blocks), nothing decoded
    computed = llm.engine.scheduler.stats.num_scheduled_tokens - steps_before
    assert len(prompts[0]) <= computed <= sum(len(p) for p in prompts)
    assert llm.engine.scheduler.stats.num_kv_blocks_used == 0


def test_delta_requests_get_prompt_logprobs_in_their_first_output(llm: LLM) -> None:
    engine = llm.engine
    prompt = llm.tokenizer.encode(TEXTS[0])
    engine.add_request("delta", prompt, SamplingParams(
        temperature=0.0, max_tokens=4, prompt_logprobs=2, output_kind=RequestOutputKind.DELTA))
    engine.add_request("cumulative", prompt, SamplingParams(
        temperature=0.0, max_tokens=4, prompt_logprobs=2))
    outputs: dict[str, list[RequestOutput]] = {"delta": [], "cumulative": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    delta, cumulative = outputs["delta"], outputs["cumulative"]
    assert len(delta) == len(cumulative) == 4
    assert delta[0].prompt_logprobs is not None and len(delta[0].prompt_logprobs) == len(prompt)
    assert all(o.prompt_logprobs is None and o.prompt_token_ids == [] for o in delta[1:])
    for out in cumulative:  # (the same values: computed in the same steps, other rows)
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        got = [e.logprob for e in out.prompt_logprobs[1:]]  # type: ignore[union-attr]
        want = [e.logprob for e in delta[0].prompt_logprobs[1:]]  # type: ignore[union-attr]
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_tensorrt_refuses_prompt_logprobs_naming_the_field(path: Path) -> None:
    """TensorRT's profiles return one logits row per sequence: a request asking for prompt
    logprobs is a RequestRejected naming the field (the server's 400), checked at add_request
    (the stage's class attribute; no TensorRT needed)."""
    from inferflow.engine.llm_engine import LLMEngine
    from inferflow.models.checkpoint import load_checkpoint
    from inferflow.scheduling.config import SchedulerConfig
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.scheduler import Scheduler
    from inferflow.stages.detokenizer import StreamingDetokenizer
    from inferflow.stages.executor import OnnxRuntimeExecutor, TensorRTExecutor

    assert OnnxRuntimeExecutor.returns_prompt_logprobs
    assert not TensorRTExecutor.returns_prompt_logprobs
    layout = KVLayout.plan(2, 64, BLOCK, 0)
    engine = LLMEngine(load_checkpoint(path), TensorRTExecutor(),
                       Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), layout),
                       StreamingDetokenizer())
    with pytest.raises(RequestRejected) as err:
        engine.add_request("x", [5, 6, 7], SamplingParams(prompt_logprobs=1))
    assert err.value.field == "prompt_logprobs" and "tensorrt" in str(err.value)
    assert not engine.has_unfinished_requests()
    engine.add_request("y", [5, 6, 7], SamplingParams(max_tokens=1))  # without: queued
    assert engine.has_unfinished_requests()
