"""generation_config.json as request defaults and extra EOS ids (vLLM's --generation-config)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from engine_factories import PROMPTS

from inferflow import LLM, SamplingParams
from inferflow.config import ConfigError, ModelConfig, typed_config
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.errors import CheckpointError
from inferflow.models.generation_config import GenerationDefaults, load_generation_defaults
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.server.http.protocol import ChatCompletionRequest, parse_body

SMALL = TinySpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                 vocab_size=512, max_position_embeddings=256, llama3_rope_scaling=False)


def _write(folder: Path, content: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (folder / "generation_config.json").write_text(text)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("gen") / "ckpt", SMALL)


def test_the_fields_vllm_applies_and_the_ones_kept_aside(tmp_path: Path) -> None:
    _write(tmp_path, {
        "temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "min_p": None,
        "do_sample": True, "max_length": 4096, "bos_token_id": 1, "eos_token_id": [9, 2, 9],
        "repetition_penalty": 1.05, "min_p_unknown": 3, "no_repeat_ngram_size": 0,
        "typical_p": 0.9,
    })
    d = load_generation_defaults(tmp_path)
    assert d.applied == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 7,
                         "repetition_penalty": 1.05}
    assert d.not_applied == {"typical_p": 0.9}  # neutral values are not listed
    assert d.eos_token_ids == (2, 9)
    assert d.describe() == {"source": "auto", "applied": dict(d.applied),
                            "not_applied": {"typical_p": 0.9}, "eos_token_ids": [2, 9]}
    params = d.sampling_params(seed=3)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.9, 20, 7)
    assert params.repetition_penalty == 1.05
    assert params.seed == 3


def test_do_sample_false_alone_is_not_greedy_and_one_eos_id(tmp_path: Path) -> None:
    d = load_generation_defaults(_write(tmp_path, {"do_sample": False, "eos_token_id": 4}))
    assert d.applied == {} and d.eos_token_ids == (4,)
    assert d.sampling_params() == SamplingParams()


def test_modes_auto_none_and_folder(checkpoint: Path, tmp_path: Path) -> None:
    assert load_generation_defaults(tmp_path / "nothing_here") == GenerationDefaults("auto")
    _write(checkpoint, {"eos_token_id": [4, 7], "temperature": 0.5})
    assert load_generation_defaults(checkpoint, "none") == GenerationDefaults("none")
    other = _write(tmp_path / "tuned", {"top_k": 3, "eos_token_id": 11})
    d = load_generation_defaults(checkpoint, str(other))
    assert d.source == "tuned" and d.applied == {"top_k": 3} and d.eos_token_ids == (11,)
    with pytest.raises(CheckpointError, match=r"empty/generation_config\.json: missing"):
        load_generation_defaults(checkpoint, str(tmp_path / "empty"))


def test_checkpoint_stop_set_takes_the_generation_config_eos_ids(checkpoint: Path) -> None:
    _write(checkpoint, {"eos_token_id": [4, 7]})
    assert load_checkpoint(checkpoint).eos_token_ids == (4, 7)  # config.json and tokenizer: 4
    assert load_checkpoint(checkpoint, "none").eos_token_ids == (4,)


def test_settings_not_applied_are_logged_once_at_load(
    checkpoint: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _write(checkpoint, {"typical_p": 0.9, "no_repeat_ngram_size": 3, "temperature": 0.7,
                        "min_p": 0.05})
    with caplog.at_level(logging.WARNING, logger="inferflow.models.generation_config"):
        ck = load_checkpoint(checkpoint)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "typical_p=0.9" in warnings[0] and "no_repeat_ngram_size=3" in warnings[0]
    assert ck.generation.applied == {"temperature": 0.7, "min_p": 0.05}


@pytest.mark.parametrize(("content", "problem"), [
    ("{not json", "cannot be parsed"),
    ("[1, 2]", "must hold a JSON object"),
    ({"temperature": "hot"}, "temperature: must be a number"),
    ({"top_k": 2.5}, "top_k: must be an integer"),
    ({"top_p": 0.0}, "top_p: must be in"),
    ({"max_new_tokens": -1}, "max_new_tokens: must be an integer >= 0"),
    ({"eos_token_id": "</s>"}, "eos_token_id: must be a token id"),
    ({"eos_token_id": [2, True]}, "eos_token_id: must be a token id"),
])
def test_a_malformed_file_names_itself(tmp_path: Path, content: Any, problem: str) -> None:
    _write(tmp_path, content)
    with pytest.raises(CheckpointError, match=r"generation_config\.json") as info:
        load_generation_defaults(tmp_path)
    assert info.value.problem.startswith(problem)


def test_model_generation_config_key_is_checked(tmp_path: Path) -> None:
    model = typed_config(ModelConfig, {"generation_config": "none"}, "model")
    assert model.generation_config == "none"
    folder = _write(tmp_path / "g", {"top_k": 1})
    assert typed_config(ModelConfig, {"generation_config": str(folder)}, "model")
    for bad in (str(tmp_path / "missing"), str(tmp_path), "vllm"):
        with pytest.raises(ConfigError, match=r"^model\.generation_config: must be auto, none"):
            typed_config(ModelConfig, {"generation_config": bad}, "model")


def test_llm_uses_the_defaults_and_extra_eos_ids(checkpoint: Path, tmp_path: Path) -> None:
    _write(checkpoint, {"eos_token_id": 4})
    llm = LLM(checkpoint, max_slots=2, max_model_len=128, max_num_batched_tokens=64)
    assert llm.get_default_sampling_params() == SamplingParams()
    base = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=12,
                                                   ignore_eos=True))[0]
    tokens = base.outputs[0].token_ids
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # a new token
    stop = tokens[at]
    assert 4 not in tokens[: at + 1]  # (the seeded model reaches it before its own EOS)
    tuned = _write(tmp_path / "tuned", {"temperature": 0.0, "max_new_tokens": 12,
                                        "eos_token_id": [stop]})
    llm = LLM(checkpoint, generation_config=str(tuned), max_slots=2, max_model_len=128,
              max_num_batched_tokens=64)
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 12)
    out = llm.generate(PROMPTS[0])[0].outputs[0]  # greedy by default, stops at the new EOS id
    assert out.token_ids == tokens[: at + 1] and out.finish_reason == "stop"
    # a request's own parameters win (ignore_eos: the full length)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert out[0].outputs[0].token_ids == tokens[:5]


def test_request_fields_win_over_the_model_defaults() -> None:
    defaults = GenerationDefaults("auto", {"temperature": 0.2, "top_p": 0.5, "top_k": 7})
    messages = [{"role": "user", "content": "hi"}]
    body = parse_body(ChatCompletionRequest, {"model": "m", "messages": messages, "top_p": 0.9})
    params = body.sampling_params(8, None, defaults)
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 7)
    params = body.sampling_params(8, None)  # no defaults: the neutral values
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 0.9, 0)
