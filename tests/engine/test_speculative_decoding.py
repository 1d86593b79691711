"""Speculative decoding (n-gram drafts) in the engine: same output as without it.

Greedy: token for token, on the trained default, alone and in a continuous batch, with the
prefix cache on, on the slot (ONNX Runtime) and paged (torch) KV layouts. Temperature 1: the
sampled distribution is the target's (a two-sample chi-square test on an 8-token vocabulary).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chi2_contingency
from spec_factories import make_tiny_vocab_checkpoint

from inferflow import LLM, SamplingParams
from inferflow.models.tiny import tiny_llama_path
from inferflow.scheduling.integrity import check_scheduler

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
REPETITIVE = [
    ".. function:: open(file, mode='r')\n\n   Open *file* and return a file object.\n\n"
    ".. function:: open(",
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return",
    "The list, the list, the list, the list",
]
PLAIN = ["The Python tutorial", "Exceptions are raised when", "import os\n"]


def greedy(max_tokens: int = 48, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=["onnxruntime", "torch"])
def pair(request: pytest.FixtureRequest) -> tuple[LLM, LLM]:
    """(plain, speculative) engines on the trained default: slots or paged blocks."""
    kw: dict[str, object] = {"max_num_seqs": 4, "max_num_batched_tokens": 64,
                             "enable_prefix_caching": True}
    if request.param == "torch":
        kw.update(backend="torch", compile="eager", max_model_len=256, num_blocks=96)
    else:
        kw.update(max_slots=4, max_model_len=256)
    return LLM(tiny_llama_path(), **kw), LLM(tiny_llama_path(), speculative_config=NGRAM, **kw)


def test_greedy_output_is_unchanged_alone_and_in_a_batch(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    prompts = REPETITIVE + PLAIN  # 6 prompts, 4 rows: requests join and leave the batch
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy())]
    batched = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy())]
    alone = [spec.generate(p, greedy())[0].outputs[0].token_ids for p in prompts]
    again = [o.outputs[0].token_ids for o in spec.generate(prompts, greedy())]  # prefix hits
    assert batched == want and alone == want and again == want
    stats = spec.engine.scheduler.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected ones
    assert spec.engine.scheduler.stats.prefix_cache_hits > 0
    check_scheduler(spec.engine.scheduler)
    assert spec.engine.scheduler.stats.num_kv_blocks_used == 0


def test_logprobs_stops_and_limits_behave_as_without_it(pair: tuple[LLM, LLM]) -> None:
    plain, spec = pair
    base = plain.generate(REPETITIVE[1], greedy(40))[0].outputs[0]
    cases = [greedy(40, logprobs=3), greedy(40, stop=[base.text[20:24]]),
             greedy(40, stop_token_ids=[base.token_ids[12]]), greedy(7), greedy(40, min_tokens=30)]
    for params in cases:
        want = plain.generate(REPETITIVE[1], params)[0].outputs[0]
        got = spec.generate(REPETITIVE[1], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        if params.logprobs is not None:
            assert got.logprobs is not None and want.logprobs is not None
            for g, w in zip(got.logprobs, want.logprobs, strict=True):
                assert g.token_id == w.token_id and g.logprob == pytest.approx(w.logprob, abs=1e-4)
                assert [t for t, _ in g.top] == [t for t, _ in w.top]


def test_seeded_sampling_with_speculation_is_reproducible(pair: tuple[LLM, LLM]) -> None:
    _, spec = pair
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=32)
    alone = spec.generate(REPETITIVE[0], params)[0].outputs[0].token_ids
    mixed = spec.generate([PLAIN[0], REPETITIVE[0]], [greedy(), params])[1].outputs[0].token_ids
    assert alone == mixed and len(alone) == 32


@pytest.mark.slow  # 3,000 seeded samples each way
def test_temperature_one_keeps_the_target_distribution(tmp_path_factory: pytest.TempPathFactory) -> None:
    """3,000 seeded samples of 6 tokens from an 8-token model, with and without drafts: at
    every position the two token histograms agree (chi-square two-sample test, p > 0.001; the
    seeds are fixed, so the outcome is deterministic). A sampler that accepted every draft,
    or drew the replacement from p without removing the rejected draft, fails it."""
    path = make_tiny_vocab_checkpoint(tmp_path_factory.mktemp("vocab8") / "ckpt")
    prompt = [0, 2, 3, 5, 2, 3, 5, 2, 3]  # repetitive: the n-gram proposer has drafts
    n = 3000
    params = [SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=i)
              for i in range(n)]
    samples = []
    # 1-token matches too: on 8 tokens they are frequent, so most rows carry drafts
    for speculative in (None, {**NGRAM, "prompt_lookup_min": 1}):
        llm = LLM(path, max_slots=64, max_num_seqs=64, max_model_len=64,
                  speculative_config=speculative)
        outs = llm.generate([prompt] * n, params)
        samples.append(np.array([o.outputs[0].token_ids for o in outs]))
    stats = llm.engine.scheduler.spec_stats
    assert stats.num_drafts > n and 0.1 < stats.acceptance_rate < 0.9  # drafts both ways
    for position in range(6):
        table = np.array([np.bincount(s[:, position], minlength=8) for s in samples])
        table = table[:, table.sum(axis=0) > 0]
        p_value = chi2_contingency(table).pvalue
        assert p_value > 1e-3, (position, table)


def test_engine_without_a_proposer_sends_no_drafts(tmp_path: Path) -> None:
    llm = LLM(tiny_llama_path(), max_slots=2, max_model_len=128)
    llm.generate(REPETITIVE[2], greedy(16))
    assert llm.engine.scheduler.drafts is None
    assert llm.engine.scheduler.spec_stats.num_drafts == 0


def test_an_offline_engine_refuses_drafts_its_executor_cannot_verify() -> None:
    with pytest.raises(ValueError, match="tensorrt executor does not verify drafts"):
        LLM(tiny_llama_path(), backend="tensorrt", graph_form="canonical", precision="fp16",
            speculative_config=NGRAM)
    with pytest.raises(ValueError, match=r"speculative_config\.method"):
        LLM(tiny_llama_path(), speculative_config={"method": "eagle"})
