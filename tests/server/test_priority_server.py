"""``priority`` over HTTP: under the default ``batching.policy=fcfs`` a non-default priority is a
400 naming the field (vLLM's behaviour), not accepted and ignored."""

from __future__ import annotations

import openai
import pytest
from server_harness import MODEL, ServerProcess

pytestmark = pytest.mark.server


def test_a_priority_the_fcfs_policy_would_ignore_is_a_400(server: ServerProcess) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"priority": 5})
    assert info.value.body["param"] == "priority"
    assert "batching.policy=priority" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, extra_body={"priority": -1})
    assert info.value.body["param"] == "priority"
    done = client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                     extra_body={"priority": 0})  # the default: fine
    assert done.choices[0].finish_reason == "length"
