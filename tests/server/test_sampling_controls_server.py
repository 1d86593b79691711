"""Sampling controls over HTTP with the ``openai`` client: penalties, ``min_p`` and
``logit_bias`` change what is generated, logprobs stay raw, and a bad value is a 400 naming the
field (on the shared default server)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server]

PROMPT = "The list, the list, the list, the list"


def complete(server: ServerProcess, **kwargs: Any) -> Any:
    extra = {k: kwargs.pop(k) for k in ("repetition_penalty", "min_p") if k in kwargs}
    kwargs = {"max_tokens": 16, "temperature": 0.0, **kwargs}
    return server.client().completions.create(
        model=MODEL, prompt=PROMPT, extra_body=extra or None, **kwargs
    ).choices[0]


def test_penalties_and_min_p_change_the_output(server: ServerProcess) -> None:
    plain = complete(server).text
    assert complete(server).text == plain  # greedy: reproducible
    for controls in ({"frequency_penalty": 1.0}, {"presence_penalty": 1.5},
                     {"repetition_penalty": 1.5}):
        assert complete(server, **controls).text != plain, controls
    # min_p = 1 keeps only the top token: sampling at temperature 1.5 is greedy again
    assert complete(server, temperature=1.5, seed=3).text != plain
    assert complete(server, temperature=1.5, seed=3, min_p=1.0).text == plain
    chat = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=16,
        temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0,
    )
    assert chat.choices[0].message.content


def test_logit_bias_forces_a_token_and_logprobs_stay_raw(server: ServerProcess) -> None:
    from tokenizers import Tokenizer

    from inferflow.models.tiny import tiny_llama_path

    tok = Tokenizer.from_file(str(tiny_llama_path() / "tokenizer.json"))
    forced_id = tok.token_to_id("list")
    assert forced_id is not None
    first = complete(server, max_tokens=1, logprobs=1)  # unbiased
    forced = complete(server, max_tokens=4, logprobs=1, logit_bias={str(forced_id): 100})
    assert forced.text == tok.decode([forced_id] * 4)
    # logprobs of the raw distribution: the forced token is unlikely there, and the top
    # alternative is the unbiased greedy token with its unbiased logprob
    assert forced.logprobs.tokens[0] != first.logprobs.tokens[0]
    assert forced.logprobs.token_logprobs[0] < -1.0
    assert forced.logprobs.top_logprobs[0] == pytest.approx(first.logprobs.top_logprobs[0])
    banned = complete(server, max_tokens=8, logit_bias={str(forced_id): -100})
    assert "list" not in banned.text


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("min_p", 1.5), ("logit_bias", {"abc": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {"99999999": 1}),  # past the vocabulary: the engine refuses it
])
def test_a_bad_value_is_a_400_naming_the_field(server: ServerProcess, field: str,
                                               value: object) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                           extra_body={field: value})
    body = info.value.body
    assert isinstance(body, dict) and str(body["param"]).split(".")[0] == field, body
