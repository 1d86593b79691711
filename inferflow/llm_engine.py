"""LLMEngine: scheduler + compiled-engine executor + detokenizer, stepped by its owner.

The step is DESIGN §1's three calls (``inferflow.scheduling.engine_loop.step``); around it the
engine only turns scheduler updates into :class:`RequestOutput` deltas (detokenization, stop
strings). It does no I/O and starts no threads: the offline ``LLM`` and the server's loop drive it.
Thread safety: every public method takes one lock, so a server may add/abort from request threads
while another thread steps.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from inferflow.engines.config import EngineConfig
from inferflow.engines.executor import EngineExecutor
from inferflow.engines.factory import create_model_engine
from inferflow.models.checkpoint import Checkpoint, load_checkpoint
from inferflow.outputs import CompletionOutput, RequestOutput
from inferflow.sampling.detokenizer import IncrementalDetokenizer
from inferflow.sampling.sampler import Sampler
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.config import SchedulerConfig
from inferflow.scheduling.engine_loop import Executor
from inferflow.scheduling.engine_loop import step as engine_step
from inferflow.scheduling.request import Request, RequestStatus
from inferflow.scheduling.scheduler import Scheduler
from inferflow.scheduling.updates import RequestUpdate, SchedulerStats


class RequestRejected(ValueError):
    """A request the engine can never run; ``field`` names the offending request field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


DetokenizerFactory = Callable[[SamplingParams], IncrementalDetokenizer]


class LLMEngine:
    def __init__(self, checkpoint: Checkpoint, engine_config: EngineConfig | None = None,
                 scheduler_config: SchedulerConfig | None = None,
                 detokenizer_factory: DetokenizerFactory | None = None) -> None:
        engine_config = engine_config or EngineConfig()
        self.checkpoint = checkpoint
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.engine = create_model_engine(checkpoint, engine_config)
        # The engine's physical layout is the truth for slots, capacity and blocks.
        self.scheduler_config = dataclasses.replace(
            scheduler_config or SchedulerConfig(), max_slots=self.engine.num_slots,
            max_model_len=self.engine.capacity, block_size=engine_config.block_size,
            num_blocks=engine_config.resolved_num_blocks)
        self.scheduler = Scheduler(self.scheduler_config)
        # any Executor (e.g. telemetry's TracedExecutor) may wrap this one
        self.executor: Executor = EngineExecutor(self.engine, Sampler(checkpoint.eos_token_ids))
        self._detokenizer_factory = detokenizer_factory or (
            lambda p: IncrementalDetokenizer(self.tokenizer, p.stop))
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        self._aborted: list[Request] = []  # reported by the next step()
        self._lock = threading.RLock()

    @classmethod
    def from_path(cls, path: str | Path, **engine_kwargs: object) -> LLMEngine:
        # slots, capacity and blocks are the engine's physical layout: EngineConfig owns them
        physical = {"max_slots", "max_model_len", "block_size", "num_blocks"}
        sched_fields = {f.name for f in dataclasses.fields(SchedulerConfig)} - physical
        sched = {k: v for k, v in engine_kwargs.items() if k in sched_fields}
        eng = {k: v for k, v in engine_kwargs.items() if k not in sched}
        return cls(load_checkpoint(path), EngineConfig(**eng),  # type: ignore[arg-type]
                   SchedulerConfig(**sched))  # type: ignore[arg-type]

    @property
    def max_model_len(self) -> int:
        return self.engine.capacity

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, prompt: str | None = None) -> None:
        """Queue a request. Raises :class:`RequestRejected` if it can never run here."""
        if not prompt_token_ids:
            raise RequestRejected("prompt", "the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected("prompt", f"the prompt has {len(prompt_token_ids)} tokens; this model's "
                                  f"maximum context length is {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected("prompt", f"token ids must be in [0, {vocab})")
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_ids=self.checkpoint.eos_token_ids,
                          arrival_time=arrival_time if arrival_time is not None else time.time(),
                          priority=priority)
        with self._lock:
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                raise RequestRejected("prompt", str(exc)) from None
            self._detok[request_id] = self._detokenizer_factory(params)
            self._prompts[request_id] = prompt

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request: its slot and KV blocks are freed now; the next step() reports it."""
        with self._lock:
            done = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            self._aborted.extend(done)
            return bool(done)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def stats(self) -> SchedulerStats:
        with self._lock:
            return self.scheduler.stats

    def step(self) -> list[RequestOutput]:
        """One engine step; returns a delta for every request that progressed or finished."""
        with self._lock:
            updates = engine_step(self.scheduler, self.executor)
            outputs = [self._output(u) for u in updates]
            for request in self._aborted:
                outputs.append(self._output(RequestUpdate(request, (), finish_reason="abort")))
            self._aborted.clear()
            return outputs

    def _output(self, update: RequestUpdate) -> RequestOutput:
        request = update.request
        rid = request.request_id
        detok = self._detok[rid]
        finish, stop_reason = update.finish_reason, update.stop_reason
        delta = detok.add(update.new_token_ids, final=finish is not None)
        if detok.stop_reason is not None and finish is None:
            # a stop string matched: end the request now (frees its slot and blocks)
            self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
            finish, stop_reason = "stop", detok.stop_reason
        elif detok.stop_reason is not None:
            finish, stop_reason = "stop", detok.stop_reason
        completion = CompletionOutput(
            index=0, text=detok.output_text, token_ids=list(request.output_token_ids),
            finish_reason=finish, stop_reason=stop_reason,
            logprobs=list(request.logprobs) if request.sampling_params.logprobs is not None else None,
            delta_text=delta, delta_token_ids=list(update.new_token_ids))
        if finish is not None:
            request.metrics.finished_time = request.metrics.finished_time or time.time()
            self._detok.pop(rid, None)
            prompt = self._prompts.pop(rid, None)
        else:
            prompt = self._prompts.get(rid)
        return RequestOutput(rid, prompt, list(request.prompt_token_ids), [completion],
                             finished=finish is not None, metrics=request.metrics)
