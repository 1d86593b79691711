"""Many concurrent streams through continuous batching give the same text as one at a time, on
both executors (slot KV and paged KV)."""

from __future__ import annotations

import asyncio

import pytest
from server_harness import MODEL, ServerProcess

pytestmark = [pytest.mark.server, pytest.mark.slow, pytest.mark.xdist_group("torch_server")]

NUM_REQUESTS = 32
MAX_TOKENS = 24


def prompts() -> list[str]:
    topics = ["the sea", "a robot", "winter", "a city", "music", "a garden", "the moon", "trains"]
    return [f"Tell me about {topics[i % len(topics)]}, part {i}:" for i in range(NUM_REQUESTS)]


async def _stream(client, prompt: str) -> tuple[str, set[str], str | None, int]:
    stream = await client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, ids, finish, usage = [], set(), None, 0
    async for chunk in stream:
        ids.add(chunk.id)
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return "".join(text), ids, finish, usage


async def _all_at_once(server: ServerProcess) -> list[tuple[str, set[str], str | None, int]]:
    client = server.async_client()
    try:
        return await asyncio.gather(*(_stream(client, p) for p in prompts()))
    finally:
        await client.close()


def test_concurrent_streams_match_sequential_greedy(server_per_executor: ServerProcess) -> None:
    server = server_per_executor
    client = server.client()
    sequential = []
    for prompt in prompts():
        out = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
        sequential.append(
            (out.choices[0].text, out.choices[0].finish_reason, out.usage.completion_tokens)
        )
    concurrent = asyncio.run(_all_at_once(server))
    assert len(concurrent) == NUM_REQUESTS
    for (text, ids, finish, usage), (seq_text, seq_finish, seq_usage) in zip(
        concurrent, sequential, strict=True
    ):
        assert text == seq_text
        assert finish == seq_finish
        assert usage == seq_usage
        assert len(ids) == 1  # one id per completion across all its chunks
    assert len({next(iter(ids)) for _, ids, _, _ in concurrent}) == NUM_REQUESTS
    stats = server.wait_until(lambda s: s["in_flight"] == 0, what="all requests released")
    assert stats["engine"]["running"] == 0
