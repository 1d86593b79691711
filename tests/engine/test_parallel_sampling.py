"""Offline ``n`` / ``best_of`` (``LLM.generate``; ``inferflow/engine/choices.py``): one output
per prompt with n sequences, the prompt computed once and shared through the prefix cache
(``prompt_leader``), in the slot (ONNX Runtime) and paged (torch) layouts."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import ORT_FORMS, llm_on, make_named_checkpoint

from inferflow import LLM, SamplingParams
from inferflow.engine.choices import cumulative_logprob
from inferflow.engine.llm_engine import RequestRejected

BLOCK = 8
TEXT = "Once upon a time there was a robot who lived in a small house by the sea, and"


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_named_checkpoint(tmp_path_factory.mktemp("parallel"), "gqa8x2")


@pytest.fixture(scope="module", params=[*ORT_FORMS, "torch"])
def llm(request: pytest.FixtureRequest, path: Path) -> LLM:
    return llm_on(path, request.param, max_num_seqs=4, max_num_batched_tokens=64,
                  block_size=BLOCK, enable_prefix_caching=True, max_model_len=128)


def sampled(seed: int | None, max_tokens: int = 6, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                          **kw)  # type: ignore[arg-type]


def test_n_choices_compute_the_prompt_once_and_equal_running_alone(llm: LLM) -> None:
    text = TEXT + " once more"  # a prompt no other test caches
    prompt = llm.tokenizer.encode(text)
    assert len(prompt) > 2 * BLOCK + 1
    before = llm.engine.stats()
    [out] = llm.generate(text, sampled(7, n=3))
    after = llm.engine.stats()
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    assert all(c.finish_reason == "length" and c.logprobs is None for c in out.outputs)
    tail = len(prompt) - (len(prompt) - 1) // BLOCK * BLOCK  # after the full blocks
    decodes = 3 * 5
    # the prompt once, then only the two siblings' tails (their full blocks were cache hits)
    assert after.num_scheduled_tokens - before.num_scheduled_tokens == \
        len(prompt) + 2 * tail + decodes
    assert after.prefix_cache_hits - before.prefix_cache_hits == 2 * (len(prompt) - tail)
    alone = [llm.generate(text, sampled(7 + i))[0].outputs[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone]
    assert [c.text for c in out.outputs] == [c.text for c in alone]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # other seeds, other samples


def test_best_of_keeps_the_n_most_likely_sequences(llm: LLM) -> None:
    [out] = llm.generate(TEXT, sampled(11, n=2, best_of=4))
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None for c in out.outputs)  # not asked for: not returned
    alone = [llm.generate(TEXT, sampled(11 + i, logprobs=0))[0].outputs[0] for i in range(4)]
    ranked = sorted(alone, key=cumulative_logprob, reverse=True)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    [asked] = llm.generate(TEXT, sampled(11, n=2, best_of=4, logprobs=1))
    assert [c.token_ids for c in asked.outputs] == [c.token_ids for c in out.outputs]
    assert all(c.logprobs is not None and len(c.logprobs) == 6 for c in asked.outputs)


def test_n_with_prompt_logprobs_and_greedy(llm: LLM) -> None:
    [out] = llm.generate(TEXT, SamplingParams(temperature=0.0, max_tokens=4, n=2,
                                               prompt_logprobs=1))
    [alone] = llm.generate(TEXT, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1))
    assert out.prompt_logprobs is not None and alone.prompt_logprobs is not None
    assert [e and e.token_id for e in out.prompt_logprobs] == \
        [e and e.token_id for e in alone.prompt_logprobs]
    for a, b in zip(out.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
        assert a is not None and b is not None and abs(a.logprob - b.logprob) < 1e-5
    assert [c.token_ids for c in out.outputs] == [alone.outputs[0].token_ids] * 2


def test_an_engine_request_is_one_sequence(llm: LLM) -> None:
    for params, field in ((SamplingParams(n=2), "n"), (SamplingParams(best_of=3), "best_of")):
        with pytest.raises(RequestRejected) as err:
            llm.engine.add_request("x", [5, 6, 7], params)
        assert err.value.field == field
    assert not llm.engine.has_unfinished_requests()
