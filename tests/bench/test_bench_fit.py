"""The bench sizes its default dataset to the server's context before sending anything."""

from __future__ import annotations

import pytest

from inferflow.bench.datasets import DatasetConfig
from inferflow.bench.fit import CHAT_OVERHEAD, WORD_TOKENS, fit_to_context
from inferflow.bench.metrics import compute_metrics
from inferflow.bench.records import RequestRecord


def test_a_default_prompt_shrinks_to_fit_the_context() -> None:
    fitted = fit_to_context(DatasetConfig(output_len=128), 2048, WORD_TOKENS)
    assert fitted.input_len is not None
    assert fitted.input_len * WORD_TOKENS + 128 + CHAT_OVERHEAD <= 2048  # the tiny model's
    big = DatasetConfig(output_len=128)
    assert fit_to_context(big, 131072, WORD_TOKENS) is big  # fits: unchanged
    assert fit_to_context(big, None, WORD_TOKENS) is big  # the server does not say


def test_lengths_the_user_chose_that_cannot_fit_fail_in_one_line() -> None:
    with pytest.raises(ValueError, match=r"--input-len 4000 .* max_model_len 2048; lower"):
        fit_to_context(DatasetConfig(input_len=4000, output_len=64), 2048, 1)
    with pytest.raises(ValueError, match=r"--output-len 4096 leaves no room"):
        fit_to_context(DatasetConfig(output_len=4096), 2048, 1)


def test_peak_output_throughput_is_never_below_the_mean() -> None:
    # two requests whose 40 tokens each came in 4 coalesced chunks: chunks/s alone < tokens/s
    records = [
        RequestRecord(
            request_id=f"r{i}",
            traceparent="",
            success=True,
            prompt_len=8,
            output_tokens=40,
            start_time=float(i),
            ttft=0.1,
            itl=[0.1, 0.1, 0.1],
            latency=0.4,
        )
        for i in range(2)
    ]
    result = compute_metrics(records, duration=2.0)
    assert result["max_output_tokens_per_s"] >= result["output_throughput"] == 40.0
