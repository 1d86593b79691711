"""The engine worker's loop with prompt logprobs and ``SubmitRequest.prompt_leader``: the first
update carries the prompt's logprobs with their text, a sibling choice reads the leader's
prompt from the prefix cache (a real engine on a thread, as in ``test_server_engine_loop``)."""

from __future__ import annotations

import time

import pytest
import test_server_engine_loop as loop_tests
from test_server_engine_loop import Running

from inferflow import LLM
from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.tiny import tiny_llama_path
from inferflow.sampling_params import SamplingParams
from inferflow.server.messages import SubmitRequest

running = loop_tests.running  # the loop on a thread, over this module's engine fixture
BLOCK = 16
TEXT = ("The robot walked along the shore of the quiet sea, counting the shells it found, "
        "and when the sun went down it sat on a rock and")


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLM(tiny_llama_path(), max_slots=4, max_model_len=256, block_size=BLOCK,
               max_num_batched_tokens=32, enable_prefix_caching=True).engine


def submit(running: Running, rid: str, prompt: list[int], params: SamplingParams,
           leader: str | None = None) -> None:
    running.requests.put(SubmitRequest(rid, 0, prompt, params, time.time(), None,
                                       prompt_leader=leader))


def test_first_update_carries_prompt_logprobs_and_a_sibling_shares_the_prompt(
        engine: LLMEngine, running: Running) -> None:
    prompt = engine.tokenizer.encode(TEXT)
    assert len(prompt) > 2 * BLOCK
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    submit(running, "lead", prompt, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True, prompt_logprobs=2))
    submit(running, "second", prompt, params, leader="lead")
    lead = running.transport.wait_final("lead")
    second = running.transport.wait_final("second")
    first, text = lead[0].prompt_logprobs, running.service.token_text
    assert first is not None and len(first) == len(prompt) and first[0] is None
    for entry, token in zip(first[1:], prompt[1:], strict=True):
        assert entry is not None and entry.token_id == token
        assert entry.token == text(token) and entry.logprob <= 0  # decoded as generated ones
        assert len(entry.top) == 2 and entry.top[0][2] >= entry.top[1][2]
        assert entry.top[1][2] >= entry.logprob or entry.token_id == entry.top[0][1]
        assert all(t == text(i) for t, i, _ in entry.top)
    assert all(u.prompt_logprobs is None for u in lead[1:] + second)
    # the sibling started once the leader's prompt was computed: its full blocks were hits
    assert second[-1].cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK
    assert lead[-1].cached_tokens == 0  # prompt logprobs: computed, not read from the cache
    assert "".join(u.text for u in lead) == "".join(u.text for u in second)


def test_max_tokens_zero_ends_at_once_with_the_prompt_logprobs(
        engine: LLMEngine, running: Running) -> None:
    prompt = engine.tokenizer.encode(TEXT)
    submit(running, "echo", prompt, SamplingParams(max_tokens=0, prompt_logprobs=0))
    updates = running.transport.wait_final("echo")
    assert len(updates) == 1
    final = updates[0]
    assert (final.finish_reason, final.text, final.completion_tokens) == ("length", "", 0)
    assert final.prompt_logprobs is not None and len(final.prompt_logprobs) == len(prompt)
    assert all(e is not None and e.top == () for e in final.prompt_logprobs[1:])
