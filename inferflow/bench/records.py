"""The two records the load generator passes around: what to send, and what was measured."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SampleRequest:
    """One request of a dataset.

    ``prompt`` is what ``/v1/completions`` receives; ``messages`` what ``/v1/chat/completions``
    receives (``None``: a single user message holding ``prompt``). ``prompt_len`` is the prompt's
    length in tokens as the dataset counted it (tokenizer tokens, or words without a tokenizer);
    the server's ``usage.prompt_tokens`` replaces it when reported.
    """

    prompt: str
    prompt_len: int
    expected_output_len: int
    messages: tuple[tuple[str, str], ...] | None = None  # ((role, content), ...)

    def chat_messages(self) -> list[dict[str, str]]:
        if self.messages is None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": role, "content": content} for role, content in self.messages]


@dataclass
class RequestRecord:
    """Client-side measurements of one request, in seconds on the ``time.perf_counter`` clock.

    Invariants for a successful record: ``ttft > 0``; ``len(itl) == number of content chunks - 1``;
    ``latency == ttft + sum(itl)`` (E2EL ends at the last content chunk, as in vLLM).
    """

    request_id: str
    traceparent: str
    prompt_len: int
    expected_output_len: int = 0
    success: bool = False
    error: str = ""
    http_status: int | None = None
    start_time: float = 0.0  # when the request was sent (after the concurrency semaphore)
    client_queue_time: float = 0.0  # time spent waiting for the concurrency semaphore
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" (server-reported) or "chunks" (counted)
    finish_reason: str | None = None
    generated_text: str = ""

    @property
    def trace_id(self) -> str:
        """The W3C trace id (32 hex digits) sent in ``traceparent``."""
        parts = self.traceparent.split("-")
        return parts[1] if len(parts) == 4 else ""
