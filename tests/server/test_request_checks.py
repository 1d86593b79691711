"""Pure request-side checks: body parsing, API keys, token buckets, settings from the config."""

from __future__ import annotations

import pytest

import inferflow.server.http.limits as limits
from inferflow.config import ConfigError, ServerConfig, typed_config
from inferflow.server.http.errors import OpenAIError
from inferflow.server.http.limits import ApiKeyAuth, RateLimiter, SharedBuckets
from inferflow.server.http.protocol import ChatCompletionRequest, CompletionRequest, parse_body


def param_of(schema: type, body: dict) -> tuple[int, str | None]:
    with pytest.raises(OpenAIError) as info:
        parse_body(schema, body)
    return info.value.info.status_code, info.value.info.param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": "m"}, "prompt"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "prompt": [[1], []]}, "prompt.1"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
        ({"model": "m", "prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        ({"model": "m", "prompt": "x", "min_p": 1.5}, "min_p"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": 101}}, "logit_bias.5"),
        ({"model": "m", "prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias.5"),
        ({"model": "m", "prompt": "x", "echo": "maybe"}, "echo"),
        ({"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ({"model": "m", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ({"model": "m", "prompt": "x", "best_of": 17}, "best_of"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"model": "m", "prompt": "x", "stop": ["", "a"]}, "stop"),
        ({"model": "m", "prompt": [True, False]}, "prompt"),  # not token ids 1 and 0
        ({"model": "m", "prompt": [1.0, 2.0]}, "prompt"),
        ({"model": "m", "prompt": [[1, True]]}, "prompt"),
    ],
)
def test_completion_body_errors_name_the_field(body: dict, param: str) -> None:
    assert param_of(CompletionRequest, body) == (400, param)


def test_chat_body_errors_name_the_field() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert param_of(ChatCompletionRequest, {"model": "m", "messages": msgs, "top_logprobs": 2}) == (
        400,
        "top_logprobs",
    )
    assert param_of(
        ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}], "n": 17}
    ) == (400, "n")
    assert param_of(
        ChatCompletionRequest, {"model": "m", "messages": msgs, "max_tokens": 0}
    ) == (400, "max_tokens")
    image = parse_body(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
        },
    )
    with pytest.raises(OpenAIError) as info:
        image.message_dicts()
    assert info.value.info.param == "messages.0.content"
    request = parse_body(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ],
        },
    )
    assert request.message_dicts() == [{"role": "user", "content": "ab"}]


def test_chat_sampling_errors_use_openai_names() -> None:
    request = parse_body(
        ChatCompletionRequest,
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "logprobs": True,
            "top_logprobs": 20,
            "min_tokens": 9,
        },
    )
    with pytest.raises(OpenAIError) as info:
        request.sampling_params(max_tokens=4, logprobs=request.num_logprobs)
    assert info.value.info.param == "min_tokens"


def test_sampling_controls_reach_sampling_params() -> None:
    from inferflow.models.generation_config import GenerationDefaults

    body = {"model": "m", "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "repetition_penalty": 1.2, "min_p": 0.1, "logit_bias": {"7": -100, "12": 3.5}}
    params = parse_body(CompletionRequest, body).sampling_params(max_tokens=4, logprobs=None)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.min_p, params.logit_bias) == (0.5, -0.25, 1.2, 0.1, {7: -100.0, 12: 3.5})
    # unset: neutral, or the model's generation_config.json default (vLLM applies those two)
    model = GenerationDefaults(applied={"repetition_penalty": 1.3, "min_p": 0.05})
    plain = parse_body(CompletionRequest, {"model": "m", "prompt": "x"})
    assert not plain.sampling_params(max_tokens=4, logprobs=None).processes_logits
    tuned = plain.sampling_params(max_tokens=4, logprobs=None, defaults=model)
    assert (tuned.repetition_penalty, tuned.min_p) == (1.3, 0.05)
    for key in ("seven", "-1", "1.5", "٣"):  # (an Arabic-Indic digit is not a token id)
        bad = parse_body(CompletionRequest, {"model": "m", "prompt": "x", "logit_bias": {key: 1}})
        with pytest.raises(OpenAIError) as info:
            bad.sampling_params(max_tokens=4, logprobs=None)
        assert (info.value.info.status_code, info.value.info.param) == (400, "logit_bias"), key


def test_single_prompt_forms() -> None:
    assert parse_body(CompletionRequest, {"model": "m", "prompt": ["x"]}).single_prompt() == "x"
    assert parse_body(CompletionRequest, {"model": "m", "prompt": [[1, 2]]}).single_prompt() == [
        1,
        2,
    ]
    assert parse_body(CompletionRequest, {"model": "m", "prompt": [3, 4]}).single_prompt() == [3, 4]


def test_prompt_batches_and_choice_counts() -> None:
    from inferflow.server.http.choices import count_choices

    body = parse_body(CompletionRequest, {"model": "m", "prompt": [[1], [2, 3]], "n": 2})
    assert body.prompts() == [[1], [2, 3]]
    assert parse_body(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).prompts() == [
        "a", "b"
    ]
    assert count_choices(body, 4) == 4
    with pytest.raises(OpenAIError) as info:
        count_choices(body, 3)
    assert info.value.info.param == "n"
    many = parse_body(CompletionRequest, {"model": "m", "prompt": ["a"] * 5})
    with pytest.raises(OpenAIError) as info:
        count_choices(many, 4)
    assert info.value.info.param == "prompt"
    best = parse_body(CompletionRequest, {"model": "m", "prompt": "a", "best_of": 5})
    with pytest.raises(OpenAIError) as info:
        count_choices(best, 4)
    assert info.value.info.param == "best_of"


def test_api_keys_bearer_or_header_and_key_ids() -> None:
    auth = ApiKeyAuth(("alpha", "beta"))
    assert auth.authenticate({"authorization": "Bearer beta"}) == "key-1"
    assert auth.authenticate({"x-api-key": "alpha"}) == "key-0"
    for headers in ({}, {"authorization": "Bearer gamma"}, {"authorization": "Basic alpha"}):
        with pytest.raises(OpenAIError) as info:
            auth.authenticate(headers)
        assert info.value.info.status_code == 401
    assert ApiKeyAuth(()).authenticate({}) == limits.OPEN_ACCESS


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_refills_continuously(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(limits.time, "monotonic", clock)
    bucket = SharedBuckets(60, ["k"])  # one unit per second
    assert bucket.take("k", 60) == 0.0
    assert bucket.take("k", 1) == pytest.approx(1.0)
    clock.now += 0.5
    assert bucket.take("k", 1) == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.take("k", 1) == 0.0
    assert bucket.take("k", 61) == 60.0  # more than the bucket holds: never; retry in a minute


def test_rate_limiter_is_per_key_and_sets_retry_after(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(limits.time, "monotonic", clock)
    limiter = RateLimiter(requests_per_minute=2, tokens_per_minute=100, key_ids=["a", "b"])
    limiter.check_request("a")
    limiter.check_request("a")
    with pytest.raises(OpenAIError) as info:
        limiter.check_request("a")
    assert info.value.info.status_code == 429
    assert info.value.info.response_headers()["Retry-After"] == "30"
    limiter.check_request("b")
    limiter.check_tokens("a", 100)
    with pytest.raises(OpenAIError) as info:
        limiter.check_tokens("a", 10)
    assert info.value.info.type == "tokens"


def test_the_frontend_runs_with_the_environment_api_keys_added() -> None:
    cfg = ServerConfig(
        port=9000,
        api_keys=["a"],
        max_waiting_requests=None,
        rate_limit_tokens_per_minute=500,
        shutdown_grace_s=3.0,
    )
    settings = cfg.with_env_api_keys(environ={"INFERFLOW_API_KEYS": "b, a ,c"})
    assert settings.port == 9000
    assert settings.api_keys == ["a", "b", "c"] and cfg.api_keys == ["a"]
    assert settings.max_waiting_requests is None
    assert settings.rate_limit_tokens_per_minute == 500
    assert settings.rate_limit_requests_per_minute is None
    assert settings.shutdown_grace_s == 3.0 and settings.log_level == "info"


def test_the_server_config_refuses_several_engine_workers() -> None:
    with pytest.raises(ConfigError, match=r"server\.workers: one engine worker"):
        typed_config(ServerConfig, {"workers": 2}, "server")


def test_admission_counts_every_engine_request_of_a_fan_out() -> None:
    from inferflow.server.shared_state import SharedState

    shared = SharedState()
    assert shared.try_admit(4, 3) and shared.in_flight == 3
    assert not shared.try_admit(4, 2) and shared.in_flight == 3  # 5 would pass the limit
    assert shared.try_admit(4) and shared.in_flight == 4
    shared.release(3)
    assert shared.in_flight == 1
