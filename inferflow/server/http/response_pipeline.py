"""Runs the serving graph's response stages on each request's output, in the API process.

Every update a request receives from the engine passes through here before it is rendered, so a
stream and a non-streamed body see exactly the same transformed text. A stage that raises
``StageError`` turns the update into an error: the stream ends with an error event, a
non-streamed request answers that status, and the frontend cancels the request in the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from inferflow.server.messages import ErrorInfo, RequestUpdate
from inferflow.stages.base import StageError, StageRequest
from inferflow.stages.response import ResponseDelta, ResponseStage


@dataclass
class ResponseRun:
    """The response stages of one request, with each stage's per-request state."""

    stages: Sequence[tuple[ResponseStage, Any]]
    done: bool = False

    def apply(self, update: RequestUpdate) -> RequestUpdate:
        """``update`` as the stages leave it (text, finish reason), or an error update."""
        if self.done:
            return update
        final = update.final
        delta = ResponseDelta(update.request_id, update.text, final, update.finish_reason)
        try:
            for stage, state in self.stages:
                delta = stage.process(delta, state)
        except StageError as exc:
            self.done = True
            if update.error is not None:  # the engine's error wins; drop the held text
                return replace(update, text="")
            error = ErrorInfo(exc.status_code, exc.message, param=exc.field, code=exc.code)
            return replace(update, text="", finish_reason=None, error=error)
        self.done = final
        finish = update.finish_reason if update.error is not None else delta.finish_reason
        return replace(update, text=delta.text, finish_reason=finish if final else None)


class ResponsePipeline:
    """The graph's response stages (already set up by ``ServingGraph.setup_stages``)."""

    def __init__(self, stages: Sequence[ResponseStage]) -> None:
        self.stages = list(stages)

    def open(self, request: StageRequest | None) -> ResponseRun | None:
        """The per-request run, or None when there are no response stages (zero cost)."""
        if not self.stages:
            return None
        source = request if request is not None else StageRequest(request_id="")
        return ResponseRun([(stage, stage.start(source)) for stage in self.stages])
