"""generation_config.json defaults and a tokenizer saved by today's transformers, on one live
server driven by the ``openai`` client over 127.0.0.1. It serves two small seeded Llamas:

- ``tuned``: its generation_config.json sets ``max_new_tokens: 5``, ``temperature: 0``, a
  ``typical_p`` inferflow does not apply, and one more EOS id (a token its greedy output
  reaches at a known position);
- ``hf-saved``: its tokenizer re-saved by transformers' ``save_pretrained`` (so the chat template
  is ``chat_template.jinja``, no longer in tokenizer_config.json); no sampling defaults.

Each model has its own defaults; transformers is the oracle for the chat acceptance check.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_harness import ServerProcess, start_server

from inferflow.models.tiny import TinySpec, make_checkpoint

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPT = "The quick brown fox"
SPEC = TinySpec(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                vocab_size=1024, max_position_embeddings=512, llama3_rope_scaling=False)
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


def _greedy_offline(path: Path, n: int) -> list[int]:
    """Greedy ids of PROMPT from the offline engine, EOS ignored, no generation defaults."""
    from inferflow import LLM, SamplingParams

    llm = LLM(path, generation_config="none", max_slots=1, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return list(llm.generate(PROMPT, params)[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The ``tuned`` checkpoint and where its extra EOS id stops greedy decoding."""
    path = make_checkpoint(tmp_path_factory.mktemp("gen_tuned") / "tuned", SPEC, seed=5)
    tokens = _greedy_offline(path, 12)
    at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    assert 4 not in tokens[: at + 1]  # (config.json's EOS comes later for this seed)
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": 0, "eos_token_id": [4, tokens[at]], "do_sample": True,
        "temperature": 0.0, "max_new_tokens": 5, "typical_p": 0.9,
    }))
    return {"path": path, "tokens": tokens, "stop_at": at}


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    path = make_checkpoint(tmp_path_factory.mktemp("gen_hf") / "hf-saved", SPEC, seed=6)
    transformers.AutoTokenizer.from_pretrained(path).save_pretrained(path)
    assert (path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((path / "tokenizer_config.json").read_text())
    return path


@pytest.fixture(scope="module")
def gen_server(
    tmp_path_factory: pytest.TempPathFactory, tuned: dict[str, Any], hf_saved: Path
) -> Iterator[ServerProcess]:
    overrides = [
        f"+models.tuned.model.path={tuned['path']}", "+models.tuned.model.name=tuned",
        f"+models.hf.model.path={hf_saved}", "+models.hf.model.name=hf-saved",
        "executor.kv_cache_memory=32MiB", "batching.max_num_seqs=4",
    ]
    server = start_server(tmp_path_factory, "gen_config", overrides)
    yield server
    server.terminate()


def _complete(server: ServerProcess, model: str, **kwargs: Any) -> Any:
    extra = {"ignore_eos": kwargs.pop("ignore_eos")} if "ignore_eos" in kwargs else None
    return server.client().completions.create(
        model=model, prompt=PROMPT, extra_body=extra, **kwargs
    )


def test_model_defaults_fill_what_the_request_leaves_unset(
    gen_server: ServerProcess, tuned: dict[str, Any]
) -> None:
    first = _complete(gen_server, "tuned", ignore_eos=True)  # no max_tokens, no temperature
    assert first.usage.completion_tokens == 5 and first.choices[0].finish_reason == "length"
    again = _complete(gen_server, "tuned", ignore_eos=True)
    assert again.choices[0].text == first.choices[0].text  # temperature 0 by default: greedy
    # a request's own values win
    short = _complete(gen_server, "tuned", ignore_eos=True, max_tokens=3)
    assert short.usage.completion_tokens == 3
    chat = gen_server.client().chat.completions.create(
        model="tuned", messages=MESSAGES, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 5  # chat: the default, not the rest of the context
    # the extra EOS id of generation_config.json stops the greedy output where it appears
    stopped = _complete(gen_server, "tuned", max_tokens=12)
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == tuned["stop_at"] + 1


def test_each_model_keeps_its_own_defaults(gen_server: ServerProcess) -> None:
    other = _complete(gen_server, "hf-saved", ignore_eos=True)
    assert other.usage.completion_tokens == 16  # OpenAI's completions default, not tuned's 5


def test_version_shows_what_is_applied(gen_server: ServerProcess, tuned: dict[str, Any]) -> None:
    models = {m["name"]: m for m in gen_server.get("/version").json()["models"]}
    assert models["tuned"]["model"]["generation_config"] == {
        "source": "auto",
        "applied": {"temperature": 0.0, "max_tokens": 5},
        "not_applied": {"typical_p": 0.9},
        "eos_token_ids": sorted({4, tuned["tokens"][tuned["stop_at"]]}),
    }
    hf = models["hf-saved"]["model"]["generation_config"]
    assert hf["applied"] == {} and hf["eos_token_ids"] == [4]


def test_chat_of_a_tokenizer_saved_by_transformers_matches_transformers_greedy(
    gen_server: ServerProcess, hf_saved: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(hf_saved)
    prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                     return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_saved, dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=16, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    chat = gen_server.client().chat.completions.create(
        model="hf-saved", messages=MESSAGES, temperature=0, max_tokens=16
    )
    assert chat.usage.prompt_tokens == len(prompt)
    assert chat.usage.completion_tokens == len(new)
    assert chat.choices[0].message.content == tok.decode(new, skip_special_tokens=True)

