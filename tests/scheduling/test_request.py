"""Request status order and the pure stop checks."""

from __future__ import annotations

import pytest

from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.request import (
    Request,
    RequestStatus,
    StopDecision,
    check_length,
    check_stop,
    check_stop_token,
    max_kv_tokens,
)

S = RequestStatus


def test_status_is_ordered_and_finished_after_preempted() -> None:
    assert S.WAITING < S.RUNNING < S.PREEMPTED < S.FINISHED_STOPPED
    assert [s.is_finished for s in S] == [False, False, False, True, True, True]
    assert [s.finish_reason for s in S] == [None, None, None, "stop", "length", "abort"]


def test_stop_token_checks() -> None:
    p = SamplingParams(max_tokens=10, stop_token_ids=[7])
    assert check_stop_token(2, 1, p, (2,)) == StopDecision(S.FINISHED_STOPPED)
    assert check_stop_token(7, 1, p, (2,)) == StopDecision(S.FINISHED_STOPPED, stop_reason=7)
    assert check_stop_token(5, 1, p, (2,)) is None
    assert check_stop_token(2, 1, SamplingParams(ignore_eos=True), (2,)) is None
    assert check_stop_token(7, 2, SamplingParams(min_tokens=3, stop_token_ids=[7]), ()) is None
    assert check_stop_token(7, 3, SamplingParams(min_tokens=3, stop_token_ids=[7]), ()) is not None


def test_length_checks() -> None:
    assert check_length(4, 10, max_tokens=4, max_model_len=100) == StopDecision(
        S.FINISHED_LENGTH_CAPPED
    )
    assert check_length(3, 10, max_tokens=4, max_model_len=100) is None
    assert check_length(3, 10, max_tokens=9, max_model_len=10) == StopDecision(
        S.FINISHED_LENGTH_CAPPED
    )
    assert check_length(3, 9, max_tokens=9, max_model_len=10) is None


def test_max_kv_tokens_follows_the_length_checks() -> None:
    assert max_kv_tokens(10, 7, max_model_len=64) == 16  # 17 tokens, the last never computed
    assert max_kv_tokens(10, 100, max_model_len=64) == 63  # capped by max_model_len
    assert max_kv_tokens(64, 5, max_model_len=64) == 64  # a full-length prompt still samples one


def test_check_stop_prefers_the_token_reason() -> None:
    r = Request("r", [1, 2, 3], SamplingParams(max_tokens=1), eos_token_ids=(9,))
    r.append_output(9)
    assert check_stop(r, 100) == StopDecision(S.FINISHED_STOPPED)
    assert r.all_token_ids == [1, 2, 3, 9] and r.num_tokens_to_compute == 4
    assert r.token_slice(2, 4) == (3, 9)


def test_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", [], SamplingParams())
