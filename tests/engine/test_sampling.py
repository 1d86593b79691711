"""Sampler: greedy, temperature, top-k, top-p, seeds, min_tokens, logprobs (pure numpy)."""

from __future__ import annotations

import numpy as np
import pytest

from inferflow.sampling.sampler import Sampler, SampleRow, filtered_probs, log_softmax
from inferflow.sampling_params import SamplingParams, SamplingParamsError

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 3.0], dtype=np.float32)


def draw(params: SamplingParams, n: int, rid: str = "r", logits: np.ndarray = LOGITS) -> list[int]:
    sampler = Sampler(eos_token_ids=[4])
    return [sampler.sample(logits[None], [SampleRow(rid, params, k)])[0].token_id for k in range(n)]


def test_greedy_is_argmax() -> None:
    assert draw(SamplingParams(temperature=0.0), 3) == [5, 5, 5]


def test_top_k_keeps_only_the_k_best() -> None:
    p = filtered_probs(LOGITS, SamplingParams(temperature=1.0, top_k=2))
    assert set(np.flatnonzero(p)) == {0, 5}
    assert set(draw(SamplingParams(top_k=2, seed=0), 200)) == {0, 5}


def test_top_p_keeps_the_smallest_nucleus() -> None:
    probs = np.exp(log_softmax(LOGITS))
    order = np.argsort(-probs)
    p = filtered_probs(LOGITS, SamplingParams(top_p=float(probs[order[:2]].sum()) - 1e-6))
    assert set(np.flatnonzero(p)) == set(order[:2].tolist())
    assert np.isclose(p.sum(), 1.0)


def test_temperature_sharpens_and_flattens() -> None:
    cold = filtered_probs(LOGITS, SamplingParams(temperature=0.1))
    hot = filtered_probs(LOGITS, SamplingParams(temperature=10.0))
    assert cold.max() > 0.99 and hot.max() < 0.3


def test_sample_frequencies_follow_the_distribution() -> None:
    tokens = draw(SamplingParams(temperature=1.0, seed=123), 4000)
    freq = np.bincount(tokens, minlength=LOGITS.size) / len(tokens)
    np.testing.assert_allclose(freq, np.exp(log_softmax(LOGITS)), atol=0.03)


def test_seed_reproducible_and_independent_of_request_id() -> None:
    params = SamplingParams(temperature=1.0, seed=42)
    assert draw(params, 30, "a") == draw(params, 30, "b")
    assert draw(params, 30) != draw(SamplingParams(temperature=1.0, seed=43), 30)


def test_a_row_samples_the_same_alone_or_in_any_batch() -> None:
    """Batched paths (greedy argmax, temperature-only draw) and per-row paths (top-k, logprobs)
    mixed in one step: every seeded row gets the token it gets alone."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 50)).astype(np.float32)
    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.3, seed=2), SamplingParams(top_k=5, seed=3),
              SamplingParams(temperature=1.0, seed=4, logprobs=2)]
    for k in range(20):  # the k-th token of each request
        rows = [SampleRow(f"r{i}", p, k) for i, p in enumerate(params)]
        together = [t.token_id for t in Sampler().sample(logits, rows)]
        alone = [Sampler().sample(logits[i:i + 1], [row])[0].token_id
                 for i, row in enumerate(rows)]
        assert together == alone


def test_min_tokens_blocks_eos_and_stop_tokens() -> None:
    logits = np.array([0.0, 0.0, 0.0, 0.0, 9.0, 8.0], dtype=np.float32)  # EOS (4) is the argmax
    params = SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4, stop_token_ids=[5])
    assert draw(params, 3, logits=logits) == [0, 0, 4]


def test_logprobs_are_of_the_raw_distribution() -> None:
    sampler = Sampler()
    tok = sampler.sample(LOGITS[None], [SampleRow("r", SamplingParams(temperature=0.0, logprobs=3), 0)])[0]
    lp = log_softmax(LOGITS)
    assert tok.token_id == 5 and tok.logprob == pytest.approx(lp[5])
    assert [t for t, _ in tok.top_logprobs] == [5, 0, 1]
    assert [v for _, v in tok.top_logprobs] == pytest.approx(lp[[5, 0, 1]].tolist())


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", -1), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -5), ("logprobs", 50),
    ("seed", -1), ("presence_penalty", 2.5), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("min_p", 1.5), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {3: 101.0}), ("n", 0), ("n", 17), ("prompt_logprobs", 21),
])
def test_bad_parameters_name_the_field(field: str, value: object) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


def test_best_of_is_at_least_n() -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(n=3, best_of=2)
    assert info.value.field == "best_of"
    assert SamplingParams(n=2, best_of=4).num_sequences == 4
