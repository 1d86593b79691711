"""``POST /tokenize`` and ``/detokenize`` in vLLM's shapes, on the default server.

Oracles: transformers' tokenizer and chat template on the same checkpoint folder, and the
server's own ``usage.prompt_tokens`` for the same prompt (what a completion really used).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from server_harness import MODEL, ServerProcess

pytestmark = pytest.mark.server

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a colour."},
]


@pytest.fixture(scope="module")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    from inferflow.compose import compose_config
    from inferflow.graph import build_graph

    path: Path = build_graph(compose_config([])).model_path  # the default server's checkpoint
    return transformers.AutoTokenizer.from_pretrained(str(path))


def chat_ids(hf_tokenizer, messages: list[dict], **kwargs: object) -> list[int]:  # type: ignore[no-untyped-def]
    out = hf_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)
    return list(out["input_ids"])


def test_tokenize_a_prompt_as_transformers_and_the_completion_count_it(
    server: ServerProcess, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    prompt = "Hello, tokenizer world!"
    out = server.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["tokens"] == hf_tokenizer(prompt)["input_ids"]
    assert body["count"] == len(body["tokens"]) and body["token_strs"] is None
    assert body["max_model_len"] == server.get("/version").json()["model"]["max_model_len"]
    used = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert used.usage.prompt_tokens == body["count"]

    plain = server.post("/tokenize", json={
        "prompt": prompt, "add_special_tokens": False, "return_token_strs": True,  # model: optional
    }).json()
    assert plain["tokens"] == hf_tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == hf_tokenizer.convert_ids_to_tokens(plain["tokens"])


def test_tokenize_a_conversation_with_the_chat_template(
    server: ServerProcess, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    body = server.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    assert body["tokens"] == chat_ids(hf_tokenizer, MESSAGES, add_generation_prompt=True)
    chat = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == body["count"]

    bare = server.post("/tokenize", json={
        "model": MODEL, "messages": MESSAGES, "add_generation_prompt": False,
    }).json()
    assert bare["tokens"] == chat_ids(hf_tokenizer, MESSAGES)

    reply = [*MESSAGES, {"role": "assistant", "content": "Blu"}]
    cont = server.post("/tokenize", json={
        "model": MODEL, "messages": reply, "add_generation_prompt": False,
        "continue_final_message": True,
    }).json()
    assert cont["tokens"] == chat_ids(hf_tokenizer, reply, continue_final_message=True)
    assert server.post("/detokenize", json={"model": MODEL, "tokens": cont["tokens"]}).json()[
        "prompt"].endswith("Blu")


def test_detokenize_round_trips_and_keeps_special_tokens(
    server: ServerProcess, hf_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    ids = server.post("/tokenize", json={"model": MODEL, "prompt": "round trip"}).json()["tokens"]
    out = server.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert out.status_code == 200
    assert out.json() == {"prompt": hf_tokenizer.decode(ids)}
    assert server.post("/detokenize", json={"model": MODEL, "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
        ("/tokenize", {"model": MODEL}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 3}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "add_special_tokens": "yes"}, 400,
         "add_special_tokens"),
        ("/tokenize", {"model": MODEL, "prompt": "x", "max_tokens": 3}, 400, "max_tokens"),
        ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "prompt": "x"}, 400, "prompt"),
        ("/tokenize", {"model": MODEL, "messages": MESSAGES, "continue_final_message": True},
         400, "continue_final_message"),
        ("/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "add_generation_prompt": False, "continue_final_message": True,
                       "chat_template": "{{ x }}"}, 400, "chat_template"),
        ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, "tokens.1"),
        ("/detokenize", {"model": MODEL, "tokens": [1, -1]}, 400, "tokens.1"),
        ("/detokenize", {"model": MODEL, "tokens": [1, True]}, 400, "tokens.1"),
        ("/detokenize", {"model": MODEL, "tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", [1, 2], 400, None),
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_an_unknown_model_a_404(
    server: ServerProcess, path: str, body: object, status: int, param: str | None
) -> None:
    out = server.post(path, json=body)
    assert out.status_code == status, out.text
    assert out.json()["error"]["param"] == param


def test_the_routes_take_the_api_keys(limited_server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "x"}
    assert limited_server.post("/tokenize", json=body).status_code == 401
    keyed = limited_server.post("/tokenize", json=body,
                                headers={"Authorization": "Bearer k-main"})
    assert keyed.status_code == 200
    tokens = keyed.json()["tokens"]
    assert limited_server.post("/detokenize", json={"model": MODEL, "tokens": tokens},
                               headers={"Authorization": "Bearer wrong"}).status_code == 401
