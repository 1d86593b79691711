"""Contract of the response-side stages: they run after the engine, on what it generated.

A response stage sees every piece of text a request produces, in order, and may transform it,
hold it back, or end the request with an error; the stream and the non-streamed body are built
from the same pieces, so a stage acts on both identically. Place one in the pipeline with
``after: detokenizer`` (or after another response stage) under ``stages:``::

    stages:
      redact_output: {_target_: my_plugin.Redactor, after: detokenizer}

Per request, in the API process that serves it:

1. ``start(request)`` once, when the request is admitted; it returns that request's state (any
   object, ``None`` by default). ``request`` is the :class:`~inferflow.stages.base.StageRequest`
   as the request stages left it (prompt, params, attributes).
2. ``process(delta, state)`` for every delta, in order; ``delta.final`` is True exactly once, on
   the last call. Return the delta to pass on (usually ``delta.with_text(new_text)``).

What a stage may do:

- **transform**: return other text. Only text changes: token ids, logprobs and usage are the
  engine's and pass through unchanged.
- **hold back**: return ``""`` and keep the text in its state; it must release everything it holds
  by the final delta (the final delta's text is the last text the client sees).
- **reject**: raise :class:`~inferflow.stages.base.StageError`. A stream then ends with an error
  event (after the text already sent); a non-streamed request answers that status. The engine
  stops generating for that request.

A stage must not depend on how the text is split into deltas (the server coalesces deltas
differently for streamed and non-streamed requests): the concatenated output for the same
concatenated input must be the same. ``process`` runs on the API process's event loop: keep it
fast (microseconds per delta) and never block. ``setup(context)`` runs once per process first.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from inferflow.stages.base import StageContext, StageRequest


@dataclass(frozen=True)
class ResponseDelta:
    """New output of one request since its previous delta.

    ``text`` is the new text (as the previous response stages left it); ``final`` marks the
    request's last delta, with ``finish_reason`` (``stop`` | ``length``) set.
    """

    request_id: str
    text: str
    final: bool = False
    finish_reason: str | None = None

    def with_text(self, text: str) -> ResponseDelta:
        return replace(self, text=text)


class ResponseStage(ABC):
    """A per-request step after the engine; see the module docstring for the contract.

    ``__init__`` takes only the stage's own config keys and must be cheap; ``name`` is set by
    the graph builder to the ``stages:`` key.
    """

    name: str = "response_stage"

    def setup(self, context: StageContext) -> None:  # noqa: B027 - optional hook, default no-op
        """Prepare per-process resources; the default does nothing."""

    def start(self, request: StageRequest) -> Any:
        """The state of one new request (default: none)."""
        return None

    @abstractmethod
    def process(self, delta: ResponseDelta, state: Any) -> ResponseDelta:
        """Transform, hold back or reject one delta."""


class HoldBackBuffer:
    """Helper for stages that rewrite text spanning several deltas (e.g. a redactor).

    ``feed(text, final, protected)`` appends ``text`` and returns the part that is safe to
    rewrite now: everything up to a ``boundary`` character at least ``window`` characters before
    the end that no span of ``protected(pending)`` covers (all of it when ``final``). With a
    window longer than anything the stage rewrites, the rewrite does not depend on how the text
    was split into deltas.
    """

    def __init__(self, window: int = 64, boundary: str = " \n\t") -> None:
        self.window = window
        self.boundary = boundary
        self.pending = ""

    def feed(
        self,
        text: str,
        final: bool,
        protected: Callable[[str], Iterable[tuple[int, int]]] = lambda _: (),
    ) -> str:
        self.pending += text
        if final:
            ready, self.pending = self.pending, ""
            return ready
        limit = len(self.pending) - self.window
        if limit <= 0:
            return ""
        spans = list(protected(self.pending))
        for cut in range(limit - 1, -1, -1):
            if self.pending[cut] in self.boundary and not any(a <= cut < b for a, b in spans):
                ready, self.pending = self.pending[: cut + 1], self.pending[cut + 1 :]
                return ready
        return ""
