"""Runs the serving graph's request stages (validator, tokenizer, plugins) in an API process.

The stages are set up once in the main process (the tokenizer is loaded there) and inherited by
the forked API processes. ``prepare`` turns a parsed OpenAI body into a ``StageRequest``, runs it
through every stage on a worker thread (one prompt at a time: a completion request with several
prompts is prepared once per prompt) (stages may be called from several threads at once, per
their contract) and returns what the engine needs. ``StageError`` becomes a 4xx naming the field.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from inferflow.models.generation_config import GenerationDefaults, load_generation_defaults
from inferflow.sampling_params import GuidedError, SamplingParams, SamplingParamsError
from inferflow.scheduling.priority import PRIORITY_IGNORED
from inferflow.server.http.errors import OpenAIError, bad_request
from inferflow.server.http.protocol import ChatCompletionRequest, CompletionRequest
from inferflow.server.observability import ATTR_TRACE_CONTEXT
from inferflow.stages.base import (
    ATTR_API_KEY_ID,
    ATTR_LORA,
    ATTR_PRIORITY,
    ATTR_USER,
    RequestStage,
    StageError,
    StageRequest,
)
from inferflow.stages.guided import GuidedDecodingStage, NoGuidedDecoding
from inferflow.stages.reasoning_parser import ReasoningParserStage, ThinkReasoningParser
from inferflow.stages.tool_parser import ToolParserStage

if TYPE_CHECKING:
    from inferflow.graph import ServingGraph
    from inferflow.models.tokenizer import Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Wraps one stage call (telemetry puts a span around it): (stage name, request) -> context.
StageWrapper = Callable[[str, StageRequest], AbstractContextManager[Any]]


def _no_wrap(name: str, request: StageRequest) -> AbstractContextManager[Any]:
    return nullcontext()


@dataclass(frozen=True)
class PreparedRequest:
    """A request ready for the engine."""

    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    trace_context: dict[str, str] = field(default_factory=dict)
    request: StageRequest | None = None  # as the request stages left it (for response stages)

    @property
    def reserved_tokens(self) -> int:
        """Tokens this request may use: what the tokens-per-minute limit charges."""
        return len(self.prompt_token_ids) + self.params.max_tokens


class RequestPipeline:
    """The graph's request stages plus what the frontend must know about the model.

    ``defaults``: the model's generation-config defaults (one pipeline per served model, each
    with its own): what a request leaves unset takes them; its own values always win. Without
    ``max_tokens``, a chat request gets the rest of the context window, a completion 16 tokens;
    a default ``max_tokens`` replaces both, capped by the rest of the context window (as vLLM).
    """

    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        stages: Sequence[RequestStage],
        wrap_stage: StageWrapper = _no_wrap,
        guided: GuidedDecodingStage | None = None,
        defaults: GenerationDefaults | None = None,
        honours_priority: bool = True,
        tokenizer: Tokenizer | None = None,
        tool_parser: ToolParserStage | None = None,
        reasoning_parser: ReasoningParserStage | None = None,
    ) -> None:
        self.model_name = model_name
        # the checkpoint's (/tokenize, /detokenize, echoed token-id prompts; None: not available)
        self.tokenizer = tokenizer
        # False under batching.policy=fcfs: a request's non-default priority is a 400
        self.honours_priority = honours_priority
        self.max_model_len = max_model_len
        self.defaults = defaults or GenerationDefaults()
        self.stages = list(stages)
        self.wrap_stage = wrap_stage
        # checks a request's structured-output constraint before it is queued (400 if it
        # cannot compile); the engine compiles it again, cached, when the request arrives
        self.guided = guided if guided is not None else NoGuidedDecoding()
        # the response parsers of chat answers (set up with the stages); a tool_choice "auto"
        # request is constrained by the tool parser's grammar when the guided stage can
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    @classmethod
    def from_graph(cls, graph: ServingGraph, wrap_stage: StageWrapper = _no_wrap) -> RequestPipeline:
        """Set up the graph's stages (loads the tokenizer and the generation config) and wrap
        them."""
        context = graph.setup_stages()
        defaults = load_generation_defaults(graph.model_path, graph.model.generation_config)
        return cls(
            graph.model_name, graph.max_model_len, graph.request_stages, wrap_stage, graph.guided,
            defaults, graph.batching.honours_priority, context.tokenizer, graph.tool_parser,
            graph.reasoning_parser,
        )

    def checkpoint_tokenizer(self) -> Tokenizer:
        """The checkpoint's tokenizer (the one the tokenizer stage encodes with)."""
        if self.tokenizer is None:
            raise OpenAIError.of(500, "this model has no tokenizer", code="pipeline_error")
        return self.tokenizer

    def _reasoning_end(self) -> str | None:
        """The marker that closes the model's reasoning (None: it does not reason)."""
        chosen = self.reasoning_parser.resolved if self.reasoning_parser is not None else None
        return chosen.end if isinstance(chosen, ThinkReasoningParser) else None

    async def prepare(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        key_id: str,
        trace_context: Mapping[str, str],
        prompt_index: int = 0,
        lora: str | None = None,
    ) -> PreparedRequest:
        """Run ``body`` (its prompt ``prompt_index`` for a completion) through the stages;
        ``trace_context`` is the root span's W3C carrier; ``lora``: the adapter ``model``
        named (the stages see it as ``attributes["lora"]``)."""
        if body.priority != 0 and not self.honours_priority:
            raise bad_request(PRIORITY_IGNORED, "priority")
        request, fill_context = self._stage_request(body, key_id, prompt_index)
        if lora is not None:
            request.attributes[ATTR_LORA] = lora
        if trace_context:
            request.attributes[ATTR_TRACE_CONTEXT] = dict(trace_context)
        request = await asyncio.to_thread(self._run_stages, request)  # each stage: its own span
        arrival = time.time()  # submitted now: stage time is not queue time
        ids = request.prompt_token_ids
        if not ids:
            raise OpenAIError.of(
                500, "the request stages produced no prompt tokens", code="pipeline_error"
            )
        params = request.sampling_params
        if fill_context:  # no max_tokens: the rest of the context, capped by the default
            rest = max(1, self.max_model_len - len(ids))
            try:
                params = replace(params, max_tokens=min(rest, self.defaults.max_tokens or rest))
            except SamplingParamsError as exc:  # (min_tokens above it)
                raise bad_request(str(exc), exc.field) from None
        priority = int(request.attributes.get(ATTR_PRIORITY, 0) or 0)
        return PreparedRequest(
            list(ids), params, priority, arrival, dict(trace_context), request=request
        )

    def _stage_request(
        self, body: CompletionRequest | ChatCompletionRequest, key_id: str, prompt_index: int = 0
    ) -> tuple[StageRequest, bool]:
        """The StageRequest for ``body``; True when max_tokens is set once the prompt length is
        known (the rest of the context window, capped by the model's default)."""
        attributes = {ATTR_PRIORITY: body.priority, ATTR_API_KEY_ID: key_id}
        if body.user is not None:
            attributes[ATTR_USER] = body.user
        # placeholder until the prompt length is known (the tokenizer checks the context)
        placeholder = max(1, body.min_tokens)
        if isinstance(body, ChatCompletionRequest):
            max_tokens = body.requested_max_tokens
            fill = max_tokens is None
            params = body.sampling_params(
                max_tokens or placeholder, body.num_logprobs, self.defaults
            )
            if self.tool_parser is not None and not isinstance(self.guided, NoGuidedDecoding):
                tool_grammar = body.auto_tool_constraint(self.tool_parser, self._reasoning_end())
                if tool_grammar is not None:
                    params = replace(params, guided=tool_grammar)
            return StageRequest(
                request_id="",
                messages=body.message_dicts(),
                sampling_params=params,
                attributes=attributes,
                tools=body.template_tools(),
            ), fill
        prompt = body.prompts()[prompt_index]
        fill = body.max_tokens is None and self.defaults.max_tokens is not None
        default = placeholder if fill else COMPLETIONS_DEFAULT_MAX_TOKENS
        max_tokens = default if body.max_tokens is None else body.max_tokens
        params = body.sampling_params(max_tokens, body.logprobs, self.defaults)
        if isinstance(prompt, str):
            return StageRequest(
                request_id="", prompt=prompt, sampling_params=params, attributes=attributes
            ), fill
        return StageRequest(
            request_id="",
            prompt_token_ids=list(prompt),
            sampling_params=params,
            attributes=attributes,
        ), fill

    def _run_stages(self, request: StageRequest) -> StageRequest:
        constraint = request.sampling_params.guided
        if constraint is not None:
            try:
                self.guided.check(constraint)
            except GuidedError as exc:
                raise bad_request(str(exc), exc.field) from None
        for stage in self.stages:
            request = self._run_stage(stage, request)
        return request

    def _run_stage(self, stage: RequestStage, request: StageRequest) -> StageRequest:
        """The one place a stage is called: telemetry's wrapper sits here."""
        try:
            with self.wrap_stage(stage.name, request):
                return stage.process(request)
        except StageError as exc:
            raise OpenAIError.of(
                exc.status_code, exc.message, param=exc.field, code=exc.code
            ) from None
        except SamplingParamsError as exc:
            raise bad_request(str(exc), exc.field) from None
