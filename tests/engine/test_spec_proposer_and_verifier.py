"""The n-gram proposer and draft verification, on their own (no engine)."""

from __future__ import annotations

import numpy as np
import pytest

from inferflow.sampling.rejection import verify_drafts
from inferflow.sampling.sampler import Sampler, SampleRow, filtered_probs
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.speculation import DraftRequest
from inferflow.stages.speculative import NgramProposer


def test_ngram_prefers_the_longest_suffix_and_its_latest_occurrence() -> None:
    p = NgramProposer(3, prompt_lookup_min=1, prompt_lookup_max=3)
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix (5, 2, 3) never occurred; (2, 3) did, last at 5 -> continues 7, 8, 5
    assert p.propose_one(tokens, 3) == (7, 8, 5)
    assert p.propose_one(tokens, 2) == (7, 8)
    assert p.propose_one([4, 5, 6], 3) == ()  # no earlier occurrence of any suffix
    assert p.propose_one([5], 3) == ()
    # the continuation may run into the suffix itself (a period-1 repetition)
    assert p.propose_one([7, 7, 7], 3) == (7,)
    only_long = NgramProposer(2, prompt_lookup_min=2, prompt_lookup_max=2)
    assert only_long.propose_one([1, 4, 2, 3, 9, 3], 2) == ()  # (9, 3) is new; 1-grams not used
    reqs = [DraftRequest("a", tokens, 1), DraftRequest("b", [4, 5, 6], 3)]
    assert p.propose(reqs) == [(7,), ()]


@pytest.mark.parametrize("bad", [{"num_speculative_tokens": 0},
                                 {"num_speculative_tokens": 2, "prompt_lookup_min": 3,
                                  "prompt_lookup_max": 2}])
def test_ngram_settings_are_checked(bad: dict[str, int]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad)) if len(bad) == 1 else "prompt_lookup_min"):
        NgramProposer(**bad)


def row(**params: object) -> SampleRow:
    return SampleRow("r", SamplingParams(max_tokens=64, **params), 0)  # type: ignore[arg-type]


def test_greedy_accepts_the_agreeing_prefix_then_the_target_token() -> None:
    logits = np.eye(6, dtype=np.float32)[[3, 1, 4, 5]] * 5  # argmax per position: 3, 1, 4, 5
    sampler = Sampler()
    tokens = [t.token_id for t in verify_drafts(sampler, logits, row(temperature=0), (3, 1, 2))]
    assert tokens == [3, 1, 4]  # third draft rejected, the target's 4 instead
    all_ok = verify_drafts(sampler, logits, row(temperature=0), (3, 1, 4))
    assert [t.token_id for t in all_ok] == [3, 1, 4, 5]  # all accepted + the bonus token
    with_lp = verify_drafts(sampler, logits, row(temperature=0, logprobs=1), (3, 0, 4))
    assert [t.token_id for t in with_lp] == [3, 1] and all(t.logprob is not None for t in with_lp)
    with pytest.raises(ValueError, match="logits rows"):
        verify_drafts(sampler, logits[:2], row(temperature=0), (3, 1, 2))


@pytest.mark.slow  # a sampled histogram per setting
@pytest.mark.parametrize("params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3},
                                    {"temperature": 1.3, "top_p": 0.8}])
def test_rejection_sampling_emits_the_target_distribution(params: dict[str, float]) -> None:
    """Exact check against the target probabilities: the first emitted token is distributed
    as p0 whatever the draft, and after an accepted first draft the second as p1."""
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1.5, (3, 5)).astype(np.float32)
    target = [filtered_probs(logits[j], SamplingParams(**params)) for j in range(3)]
    # drafts: position 0's likeliest token, position 1's second likeliest (both accepted or not)
    drafts = (int(np.argmax(target[0])), int(np.argsort(target[1])[-2]))
    sampler, n = Sampler(), 40_000
    first = np.zeros(5)
    second = np.zeros(5)
    for _ in range(n):
        out = verify_drafts(sampler, logits, row(**params), drafts)
        first[out[0].token_id] += 1
        if out[0].token_id == drafts[0]:
            second[out[1].token_id] += 1
    assert np.abs(first / n - target[0]).max() < 0.01
    assert np.abs(second / second.sum() - target[1]).max() < 0.015


def _lookup_by_brute_force(tokens: list[int], k: int, lo: int, hi: int) -> tuple[int, ...]:
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # latest occurrence first
            if tokens[start:start + n] == suffix:
                return tuple(tokens[start + n:start + n + k])
    return ()


def test_ngram_lookup_equals_the_brute_force_search() -> None:
    rng = np.random.default_rng(5)
    for _ in range(3000):
        tokens = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(1, 30))).tolist()
        lo = int(rng.integers(1, 4))
        hi, k = int(rng.integers(lo, 6)), int(rng.integers(1, 6))
        got = NgramProposer(k, lo, hi).propose_one(tokens, k)
        assert got == _lookup_by_brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)
