"""Contracts of the per-request stages that run before the engine.

A request travels through ``ServingGraph.request_stages`` in pipeline order (validator, plugin
stages such as a PII redactor, tokenizer, ...) as a :class:`StageRequest`; the last stage hands
it to the engine with ``prompt_token_ids`` filled in. Stages are built from the config (one
``_target_`` each, constructed with only their own config keys), then set up once per process
with a :class:`StageContext`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from inferflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    from inferflow.models.config import ModelArch
    from inferflow.models.tokenizer import Tokenizer

# Well-known keys of StageRequest.attributes (stages may add their own, namespaced by stage name).
ATTR_PRIORITY = "priority"  # int, lower runs first; passed to LLMEngine.add_request(priority=)
ATTR_USER = "user"  # the OpenAI ``user`` field, when the client sent one
ATTR_LORA = "lora"  # the LoRA adapter the request runs with (``model=ADAPTER``); absent: base
ATTR_API_KEY_ID = "api_key_id"  # which configured API key authenticated the request (not the key)


@dataclass
class StageRequest:
    """One request on its way to the engine.

    Exactly one of ``prompt`` (completions), ``messages`` (chat) or ``prompt_token_ids`` is set
    when the request arrives; the tokenizer stage fills ``prompt_token_ids`` from the text.
    ``attributes`` carries request metadata between the frontend and the stages (see the
    ``ATTR_*`` keys); it must stay picklable (plain values) because it may cross processes.
    """

    request_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    attributes: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI tool definitions, for the template


@dataclass(frozen=True)
class StageContext:
    """What a stage may know about the served model, handed to :meth:`RequestStage.setup`.

    ``model_config`` is the checkpoint's architecture (``inferflow.models.config.ModelArch``),
    ``tokenizer`` the checkpoint's tokenizer. ``max_model_len`` is the served context length
    (prompt + completion tokens), already capped by the config.
    """

    model_name: str
    model_path: Path
    model_config: ModelArch
    tokenizer: Tokenizer
    max_model_len: int


class StageError(Exception):
    """A client error found by a stage: the server answers ``status_code`` (4xx) in OpenAI's
    error format, with ``param=field`` and ``message``; ``code`` is OpenAI's optional error code
    (e.g. ``context_length_exceeded``)."""

    def __init__(
        self, field: str, message: str, status_code: int = 400, code: str | None = None
    ) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.status_code = status_code
        self.code = code


class RequestStage(ABC):
    """A per-request step before the engine.

    Contract:

    - ``__init__`` takes only the stage's own config keys (keyword arguments) and must be cheap:
      the graph is rebuilt in every worker process. Load models, tables, etc. in ``setup``.
    - ``setup(context)`` is called once per process, before the first ``process`` call.
    - ``process(request)`` is called once per request, in pipeline order, possibly from several
      threads at once: do not mutate shared state without a lock. It returns the request to pass
      on (the same object, modified, or a new one) and never returns ``None``.
    - Bad client input raises :class:`StageError` naming the request field; any other exception
      is a server error (HTTP 500).
    - ``process`` runs on the request path: no blocking network or disk I/O.

    ``name`` is set by the graph builder to the slot or ``stages:`` key the stage was built from.
    """

    name: str = "stage"

    def setup(self, context: StageContext) -> None:  # noqa: B027 - optional hook, default no-op
        """Prepare per-process resources; the default does nothing."""

    @abstractmethod
    def process(self, request: StageRequest) -> StageRequest:
        """Transform or check one request; raise :class:`StageError` for bad client input."""


class PassThroughStage(RequestStage):
    """The null request stage: returns every request unchanged."""

    def process(self, request: StageRequest) -> StageRequest:
        return request
