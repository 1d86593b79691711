"""inferflow's LitSpec: the OpenAI routes, registered through LitServe's spec mechanism.

LitServe's ``OpenAISpec`` serves only chat, gives every chunk a new id and always reports
``finish_reason="stop"``; this spec registers our own handlers (``Frontend``) instead. LitServe
calls ``setup(server)`` in the main process before the API processes fork; that is where the
frontend gets the request queue it submits to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from litserve.specs.base import LitSpec

from inferflow.server.http.frontend import COMPLETIONS_PATH, Frontend
from inferflow.server.http.ops import api_routes

if TYPE_CHECKING:
    from litserve import LitAPI, LitServer


class OpenAICompatibleSpec(LitSpec):
    """Routes ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` (and
    ``/v1/embeddings``) to ``frontend``, plus the operational routes (``api_routes``): all of
    them LitServe spec endpoints."""

    def __init__(self, frontend: Frontend, model_path: str = "") -> None:
        super().__init__()
        self.api_path = COMPLETIONS_PATH
        self.frontend = frontend
        self.model_path = model_path

    @property
    def stream(self) -> bool:
        return True

    def pre_setup(self, lit_api: LitAPI) -> None:
        for path, endpoint, methods in api_routes(self.frontend, self.model_path):
            self.add_endpoint(path, endpoint, methods)

    def setup(self, server: LitServer) -> None:
        super().setup(server)
        self.frontend.request_queue = self.request_queue

    def decode_request(self, request: Any, context_kwargs: Any = None) -> Any:
        return request

    def encode_response(self, output: Any, context_kwargs: Any = None) -> Any:
        return output

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["frontend"] = None  # API-process state never travels to the engine worker
        return state
