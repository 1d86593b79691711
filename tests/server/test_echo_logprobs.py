"""``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` in vLLM's shapes: the formatters
render a prompt's logprobs (as the engine delivers them in ``RequestUpdate.prompt_logprobs``)."""

from __future__ import annotations

import pytest

from inferflow.server.http.errors import OpenAIError
from inferflow.server.http.responses import (
    Accumulated,
    ChatFormatter,
    CompletionFormatter,
    PromptInfo,
)
from inferflow.server.messages import LogprobEntry, RequestUpdate

# prompt "ab c" as tokens "a", "b", " c"; the engine's entries: None first, then token + top 2
PROMPT_LOGPROBS = (
    None,
    LogprobEntry("b", 11, -1.0, (("x", 20, -0.5), ("b", 11, -1.0))),
    LogprobEntry(" c", 12, -3.0, (("y", 21, -0.25), ("z", 22, -0.75))),
)
GENERATED = (LogprobEntry("!", 13, -0.1, (("!", 13, -0.1),)),)


def prompt() -> PromptInfo:
    return PromptInfo("ab c", [10, 11, 12], "a", PROMPT_LOGPROBS)


def completion(echo: bool, logprobs: bool, prompt_logprobs: bool = False) -> CompletionFormatter:
    fmt = CompletionFormatter("m", include_usage=False, want_logprobs=logprobs)
    fmt.prompt, fmt.echo, fmt.want_prompt_logprobs = prompt(), echo, prompt_logprobs
    return fmt


def accumulated(text: str = "!", entries: tuple[LogprobEntry, ...] = GENERATED) -> Accumulated:
    acc = Accumulated()
    acc.add(RequestUpdate("r", text=text, logprobs=entries, finish_reason="length",
                          prompt_logprobs=PROMPT_LOGPROBS))
    return acc


def test_echo_with_logprobs_covers_the_prompt_tokens_as_vllm() -> None:
    choice = completion(echo=True, logprobs=True).full_choice(accumulated())
    assert choice["text"] == "ab c!"
    assert choice["logprobs"] == {
        "tokens": ["a", "b", " c", "!"],
        "token_logprobs": [None, -1.0, -3.0, -0.1],
        "top_logprobs": [
            None,
            {"b": -1.0, "x": -0.5},
            {" c": -3.0, "y": -0.25, "z": -0.75},
            {"!": -0.1},
        ],
        "text_offset": [0, 1, 2, 4],
    }


def test_max_tokens_zero_echoes_the_prompt_only() -> None:
    choice = completion(echo=True, logprobs=True).full_choice(accumulated("", ()))
    assert choice["text"] == "ab c"
    assert choice["logprobs"]["tokens"] == ["a", "b", " c"]
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -3.0]


def test_streamed_echo_sends_the_prompt_in_the_first_chunk() -> None:
    fmt = completion(echo=True, logprobs=True)
    first = fmt.delta_chunks(RequestUpdate("r", text="!", logprobs=GENERATED,
                                           prompt_logprobs=PROMPT_LOGPROBS))
    (chunk,) = first
    assert chunk["choices"][0]["text"] == "ab c!"
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [0, 1, 2, 4]
    (last,) = fmt.delta_chunks(RequestUpdate("r", text="?", finish_reason="length",
                                             logprobs=(LogprobEntry("?", 14, -2.0),)))
    assert last["choices"][0]["text"] == "?"
    assert last["choices"][0]["logprobs"]["text_offset"] == [5]
    # max_tokens 0: the only (empty) update still carries the prompt
    (only,) = completion(echo=True, logprobs=False).delta_chunks(
        RequestUpdate("r", finish_reason="length"))
    assert only["choices"][0]["text"] == "ab c" and only["choices"][0]["logprobs"] is None


def test_vllm_prompt_logprobs_on_the_choice_and_beside_chat_choices() -> None:
    expected = [
        None,
        {"11": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
         "20": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}},
        {"12": {"logprob": -3.0, "rank": None, "decoded_token": " c"},
         "21": {"logprob": -0.25, "rank": 1, "decoded_token": "y"},
         "22": {"logprob": -0.75, "rank": 2, "decoded_token": "z"}},
    ]
    choice = completion(echo=False, logprobs=False, prompt_logprobs=True).full_choice(accumulated())
    assert choice["text"] == "!" and choice["prompt_logprobs"] == expected
    chat = ChatFormatter("m", include_usage=False, want_logprobs=False)
    chat.prompt, chat.want_prompt_logprobs = prompt(), True
    acc = accumulated()
    body = chat.full_body([chat.full_choice(acc)], acc)
    assert body["prompt_logprobs"] == expected
    assert "prompt_logprobs" not in completion(echo=True, logprobs=False).full_choice(acc)


def test_missing_prompt_logprobs_are_an_error_not_a_shorter_list() -> None:
    fmt = completion(echo=True, logprobs=True)
    fmt.prompt = PromptInfo("ab c", [10, 11, 12], "a")  # the engine sent none
    with pytest.raises(OpenAIError) as info:
        fmt.full_choice(accumulated())
    assert info.value.info.status_code == 500


def test_choice_index_is_stamped_whatever_the_subclass_writes() -> None:
    first = completion(echo=False, logprobs=False)
    second = completion(echo=False, logprobs=False).sibling(first, 3)
    assert second.id == first.id and second.created == first.created
    (chunk,) = second.delta_chunks(RequestUpdate("r", text="x"))
    assert chunk["choices"][0]["index"] == 3
    assert second.full_choice(accumulated())["index"] == 3


def test_tool_call_formatter_keeps_its_choice_index() -> None:
    from inferflow.server.http.tool_calls import ToolCallFormatter

    first = ChatFormatter("m", include_usage=False, want_logprobs=False)
    tools = ToolCallFormatter("m", False, False, "auto", {"f"}).sibling(first, 2)
    call = '{"name": "f", "arguments": {"x": 1}}'
    chunks = tools.delta_chunks(RequestUpdate("r", text=call, finish_reason="stop"))
    assert chunks and all(c["choices"][0]["index"] == 2 for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    acc = Accumulated(text=call, finish_reason="stop")
    choice = tools.full_choice(acc)
    assert choice["index"] == 2 and choice["finish_reason"] == "tool_calls"
