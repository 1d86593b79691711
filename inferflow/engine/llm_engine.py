"""LLMEngine: scheduler + executor + detokenizer, stepped by its owner.

The step is DESIGN §1's three calls (``inferflow.engine.step.step``); around it the
engine only turns scheduler updates into :class:`RequestOutput` deltas (detokenization, stop
strings, ``stream_interval``). It does no I/O and starts no threads: the offline ``LLM`` and the
server's loop drive it. Thread safety: every public method takes one lock, so a server may
add/abort from request threads while another thread steps.

One constructor: it takes the serving graph's engine-side stages, which
``ServingGraph.create_engine`` assembles for the server and the offline ``LLM`` alike.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from inferflow.engine.step import Executor
from inferflow.engine.step import step as engine_step
from inferflow.models.checkpoint import Checkpoint
from inferflow.outputs import CompletionOutput, RequestOutput, StageTime
from inferflow.sampling_params import RequestOutputKind, SamplingParams
from inferflow.scheduling.priority import PRIORITY_IGNORED, honours_priority
from inferflow.scheduling.request import Request, RequestStatus
from inferflow.scheduling.scheduler import Scheduler
from inferflow.scheduling.updates import SchedulerStats, StepUpdate
from inferflow.stages.detokenizer import DetokenizerStage, RequestDetokenizer
from inferflow.stages.executor import ExecutorStage
from inferflow.stages.guided import GuidedDecodingStage, LLGuidanceDecoding

if TYPE_CHECKING:
    from inferflow.lora.registry import LoraRegistry
    from inferflow.lora.slots import LoraSlots
    from inferflow.runtimes.plan_runner import Runner


class RequestRejected(ValueError):
    """A request the engine can never run; ``field`` names the offending request field."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


# Wraps the executor the step calls (telemetry's TracedExecutor): (executor, stats) -> executor.
ExecutorWrapper = Callable[[Executor, Callable[[], SchedulerStats]], Executor]


@dataclasses.dataclass
class _Pending:
    """Output held back by ``stream_interval``: tokens since the request's last emitted delta.
    ``logprobs_from``: the request's logprobs before this index were in an earlier output;
    ``emitted``: the request has had an output already (a DELTA output carries the prompt's
    ids in its first one only)."""

    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs_from: int = 0
    emitted: bool = False


class LLMEngine:
    def __init__(self, checkpoint: Checkpoint, executor: ExecutorStage, scheduler: Scheduler,
                 detokenizer: DetokenizerStage, wrap_executor: ExecutorWrapper | None = None,
                 guided: GuidedDecodingStage | None = None, lora: LoraRegistry | None = None,
                 reserved_names: Collection[str] = ()) -> None:
        """An engine over a loaded ``executor`` and a ``scheduler`` built for the same layout;
        ``wrap_executor`` wraps what the step calls (telemetry), once, here; ``guided``: the
        structured-output stage (default: llguidance).

        Multi-LoRA: ``lora`` is the registry of the adapters requests may select (None: LoRA
        off); the executor was built with its ``LoraSpec`` (``ExecutorStage.enable_lora``) and
        the scheduler with its ``max_loras``. The engine owns the registry and the
        :class:`~inferflow.lora.slots.LoraSlots` over the executor's runner.
        ``reserved_names``: the served models' names, which no adapter loaded at run time may
        take."""
        self.checkpoint = checkpoint
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.model_executor = executor  # the executor stage: backend, versions, settings
        self.scheduler = scheduler
        self.layout = scheduler.layout
        # what the step calls: the executor stage, or a wrapper around it (telemetry)
        self.executor: Executor = executor
        if wrap_executor is not None:
            self.executor = wrap_executor(executor, lambda: scheduler.stats)
        self.detokenizer = detokenizer
        self._detok: dict[str, RequestDetokenizer] = {}
        self._pending: dict[str, _Pending] = {}
        self._prompts: dict[str, str | None] = {}
        self._aborted: list[Request] = []  # reported by the next step()
        self.guided = guided if guided is not None else LLGuidanceDecoding()
        self._guided_bound = False  # bound to the tokenizer at the first constrained request
        self._lock = threading.RLock()
        self.lora = lora
        self.lora_slots: LoraSlots | None = None
        self._reserved_names = frozenset(reserved_names)
        self._unloading: set[str] = set()  # unloaded, still used by live requests
        if lora is not None:
            from inferflow.lora.slots import LoraSlots

            if scheduler.max_loras != lora.spec.max_loras:
                raise ValueError(f"lora: the scheduler caps {scheduler.max_loras} adapters, the "
                                 f"engine has {lora.spec.max_loras} slots")
            self.lora_slots = LoraSlots(executor.runner, lora)
            # (the adapters of running requests keep their slots, in the step or not)
            executor.use_lora_slots(self.lora_slots, lambda: scheduler.running_loras)

    @property
    def engine(self) -> Runner | None:
        """The model runner of a built-in executor (e.g. ``OnnxRuntimeRunner``); None for an
        executor that loads its own way (a plugin overriding ``load``)."""
        return self.model_executor.runner if self.model_executor.loaded else None

    @property
    def max_model_len(self) -> int:
        return self.layout.max_model_len

    def describe(self) -> dict[str, Any]:
        """What runs and with which settings, read back from the live components."""
        budgets = self.scheduler.budgets
        return {
            **self.model_executor.describe(),
            "layout": dataclasses.asdict(self.layout),
            "scheduler": {
                "max_num_seqs": budgets.max_num_seqs,
                "max_num_batched_tokens": budgets.max_num_batched_tokens,
                "max_running": self.scheduler.max_running,
                "enable_prefix_caching": self.scheduler.kv.enable_prefix_caching,
                "enable_chunked_prefill": budgets.enable_chunked_prefill,
                "long_prefill_token_threshold": budgets.long_prefill_token_threshold,
                "mode": budgets.mode,
                "policy": str(budgets.policy),
                "policy_class": type(self.scheduler.policy).__name__,
            },
            "executor": self.model_executor.settings(),
            "detokenizer": {"class": type(self.detokenizer).__name__,
                            **self.detokenizer.settings()},
            "guided": {"class": type(self.guided).__name__, **self.guided.settings()},
            "speculative": self._describe_speculation(),
            "lora": self._describe_lora(),
        }

    def _describe_lora(self) -> dict[str, Any]:
        if self.lora is None:
            return {"enabled": False}
        spec = self.lora.spec
        return {"enabled": True, "max_loras": spec.max_loras, "max_lora_rank": spec.max_lora_rank,
                "targets": list(spec.targets), "adapters": self.lora_names()}

    def _describe_speculation(self) -> dict[str, Any]:
        drafts = self.scheduler.drafts
        if drafts is None:
            return {"enabled": False}
        proposer = drafts.proposer
        settings = {k: v for k, v in vars(proposer).items() if not k.startswith("_")}
        return {"enabled": True, "proposer": type(proposer).__name__, **settings}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    arrival_time: float | None = None, priority: int = 0, prompt: str | None = None,
                    prompt_leader: str | None = None, lora: str | None = None) -> None:
        """Queue a request. Raises :class:`RequestRejected` if it can never run here (also for a
        non-default ``priority`` under an order that ignores it: ``batching.policy=fcfs``).

        ``lora``: the LoRA adapter to run with (None: the base model); one not loaded (or being
        unloaded) is refused with ``field`` "model" (the API's 404).

        ``prompt_leader`` (n > 1): the id of a request added before with the same prompt; this
        one starts once the leader has computed the prompt, whose full blocks it then reads
        from the prefix cache (with the prefix cache off it just runs)."""
        if priority != 0 and not honours_priority(self.scheduler.policy):
            raise RequestRejected("priority", PRIORITY_IGNORED)
        if params.prompt_logprobs is not None and not self.model_executor.returns_prompt_logprobs:
            raise RequestRejected("prompt_logprobs", f"prompt_logprobs is not supported by "
                                  f"executor={self.model_executor.backend or type(self.model_executor).__name__}"
                                  " (its engine returns one logits row per sequence)")
        if params.num_sequences > 1:  # (n and best_of are not accepted and ignored)
            field_name = "n" if params.best_of is None or params.n > 1 else "best_of"
            raise RequestRejected(field_name, "an engine request is one sequence: fan n/best_of "
                                  "out into requests (inferflow.engine.choices.fan_out)")
        if not prompt_token_ids:
            raise RequestRejected("prompt", "the prompt is empty")
        if len(prompt_token_ids) >= self.max_model_len:
            raise RequestRejected("prompt", f"the prompt has {len(prompt_token_ids)} tokens; this model's "
                                  f"maximum context length is {self.max_model_len} tokens")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejected("prompt", f"token ids must be in [0, {vocab})")
        bad = next((t for t in params.logit_bias or () if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestRejected("logit_bias", f"token ids must be in [0, {vocab}), got {bad}")
        request = Request(request_id, list(prompt_token_ids), params,
                          eos_token_ids=self.checkpoint.eos_token_ids,
                          arrival_time=arrival_time if arrival_time is not None else time.time(),
                          priority=priority, prompt_leader=prompt_leader, lora=lora)
        with self._lock:
            if lora is not None and (self.lora is None or lora not in self.lora
                                     or lora in self._unloading):
                raise RequestRejected("model", f"the model {lora!r} does not exist (no LoRA "
                                      "adapter of that name is loaded)")
            if params.guided is not None:
                self._start_guided(request, params)
            try:
                self.scheduler.add_request(request)
            except ValueError as exc:
                self.guided.finish([request_id])
                raise RequestRejected("prompt", str(exc)) from None
            self._detok[request_id] = self.detokenizer.start(self.tokenizer, params)
            self._pending[request_id] = _Pending()
            self._prompts[request_id] = prompt

    def _start_guided(self, request: Request, params: SamplingParams) -> None:
        from inferflow.sampling_params import GuidedError

        assert params.guided is not None
        try:
            if not self._guided_bound:
                self.guided.bind(self.checkpoint.path / "tokenizer.json",
                                 self.model_config.vocab_size, self.checkpoint.eos_token_ids)
                self._guided_bound = True
            info = self.guided.start(request.request_id, params.guided)
        except GuidedError as exc:
            raise RequestRejected(exc.field, str(exc)) from None
        metrics = request.metrics
        metrics.guided_kind = params.guided.kind.value
        metrics.guided_compile_s, metrics.guided_cache_hit = info.seconds, info.cached

    def abort_request(self, request_id: str) -> bool:
        """Cancel a request: its slot and KV blocks are freed now; the next step() reports it."""
        with self._lock:
            done = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
            self.guided.finish([request_id])
            self._aborted.extend(done)
            self._finish_unloads()
            return bool(done)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def stats(self) -> SchedulerStats:
        """The scheduler's counters, with the LoRA registry's and slots' (loads, unloads)."""
        with self._lock:
            stats = self.scheduler.stats
            if self.lora is None or self.lora_slots is None:
                return stats
            return dataclasses.replace(stats, lora_loads=self.lora.loads,
                                       lora_unloads=self.lora.unloads,
                                       lora_slot_loads=self.lora_slots.loads_into_engine)

    # -- multi-LoRA ----------------------------------------------------------------------------
    def lora_names(self) -> list[str]:
        """The adapters requests may select now (sorted; none with LoRA off)."""
        with self._lock:
            if self.lora is None:
                return []
            return sorted(n for n in self.lora.names() if n not in self._unloading)

    def load_lora(self, name: str, path: str) -> None:
        """Read and check the PEFT adapter at ``path`` and serve it as ``name`` (no engine
        rebuild: it enters a slot on its first request). Raises ``LoraError`` (``field``
        ``lora_name`` or ``lora_path``): LoRA off, a bad or taken name, a bad adapter."""
        from inferflow.lora.adapter import LoraError
        from inferflow.stages.lora import check_adapter_name

        with self._lock:
            if self.lora is None:
                raise LoraError("lora_name", "this engine serves no LoRA adapters (start it "
                                "with lora.adapters.NAME=PATH or lora.allow_runtime_updates=true)")
            try:
                check_adapter_name(name, "lora_name")
            except ValueError as exc:
                raise LoraError("lora_name", str(exc).removeprefix("lora_name: ")) from None
            if name in self._reserved_names:
                raise LoraError("lora_name", f"{name!r} is the name of a served model")
            if name in self._unloading:
                raise LoraError("lora_name", f"the adapter {name!r} is being unloaded: requests "
                                "still run with it; load it again once they finished")
            if name in self.lora:
                raise LoraError("lora_name", f"the adapter {name!r} is already loaded")
            self.lora.add(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests for it are refused at once, the live ones
        finish with it, then it leaves the registry and its engine slot. Raises ``LoraError``
        (``lora_name``) for an adapter that is not loaded."""
        from inferflow.lora.adapter import LoraError

        with self._lock:
            if self.lora is None or name not in self.lora or name in self._unloading:
                raise LoraError("lora_name", f"the adapter {name!r} is not loaded")
            self._unloading.add(name)
            self._finish_unloads()

    def _finish_unloads(self) -> None:
        """Remove the unloaded adapters no live request uses any more."""
        if not self._unloading:
            return
        assert self.lora is not None and self.lora_slots is not None
        live = self.scheduler.live_loras()
        for name in [n for n in self._unloading if n not in live]:
            self.lora.remove(name)
            self.lora_slots.free(name)
            self._unloading.discard(name)

    def step(self) -> list[RequestOutput]:
        """One engine step; an output for every request that finished or, every
        ``stream_interval`` tokens, progressed (unless its ``output_kind`` is FINAL_ONLY)."""
        with self._lock:
            updates = engine_step(self.scheduler, self.executor, self.guided)
            outputs = [out for u in updates if (out := self._output(u)) is not None]
            for request in self._aborted:
                out = self._output(StepUpdate(request, (), finish_reason="abort"))
                assert out is not None  # a finished request always reports
                outputs.append(out)
            self._aborted.clear()
            self._finish_unloads()
            return outputs

    def _detokenize_each(self, request: Request, detok: RequestDetokenizer,
                         new_ids: tuple[int, ...], final: bool) -> tuple[str, tuple[int, ...]]:
        """Several tokens of one step (speculative decoding) against stop strings: one at a
        time, so a stop string that matches ends the output at that token, as it would have
        without speculation (the request ends and its later tokens are dropped)."""
        delta = ""
        for n, token in enumerate(new_ids, 1):
            delta += detok.add((token,), final=final and n == len(new_ids))
            if detok.stop_reason is not None and n < len(new_ids):
                self.scheduler.finish_requests([request.request_id], RequestStatus.FINISHED_STOPPED)
                request.truncate_output(request.num_output_tokens - (len(new_ids) - n))
                return delta, new_ids[:n]
        return delta, new_ids

    def _output(self, update: StepUpdate) -> RequestOutput | None:
        request = update.request
        rid = request.request_id
        detok = self._detok[rid]
        finish, stop_reason = update.finish_reason, update.stop_reason
        started = time.time()
        new_ids = update.new_token_ids
        if len(new_ids) > 1 and request.sampling_params.stop:
            delta, new_ids = self._detokenize_each(request, detok, new_ids, finish is not None)
        else:
            delta = detok.add(new_ids, final=finish is not None)
        ended = time.time()
        if request.metrics.detokenize is None:
            request.metrics.detokenize = StageTime(started, ended, 1, ended - started)
        else:
            request.metrics.detokenize.add(started, ended)
        if detok.stop_reason is not None:
            if finish is None:  # a stop string matched: end the request now (frees its slot and blocks)
                self.scheduler.finish_requests([rid], RequestStatus.FINISHED_STOPPED)
            finish, stop_reason = "stop", detok.stop_reason
        pending = self._pending[rid]
        pending.text += delta
        pending.token_ids.extend(new_ids)
        kind = request.sampling_params.output_kind
        if finish is None and (kind is RequestOutputKind.FINAL_ONLY
                               or len(pending.token_ids) < self.detokenizer.stream_interval):
            return None  # held back: the next delta carries these tokens too
        self._pending[rid] = _Pending(logprobs_from=request.num_output_tokens, emitted=True)
        wants_logprobs = request.sampling_params.logprobs is not None
        delta_only = kind is RequestOutputKind.DELTA  # what is new only: no copy of the past
        if delta_only:
            text, token_ids = pending.text, list(pending.token_ids)
            logprobs = request.logprobs[pending.logprobs_from:] if wants_logprobs else None
        else:
            text, token_ids = detok.output_text, list(request.output_token_ids)
            logprobs = list(request.logprobs) if wants_logprobs else None
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids, finish_reason=finish,
            stop_reason=stop_reason, logprobs=logprobs, delta_text=pending.text,
            delta_token_ids=pending.token_ids)
        first = not (delta_only and pending.emitted)  # a DELTA request's prompt comes once
        prompt_ids = list(request.prompt_token_ids) if first else []
        if finish is not None:
            request.metrics.finished_time = request.metrics.finished_time or time.time()
            self._detok.pop(rid, None)
            self._pending.pop(rid, None)
            prompt = self._prompts.pop(rid, None)
        else:
            prompt = self._prompts.get(rid)
        prompt = prompt if first else None
        prompt_logprobs = request.prompt_logprobs  # (None until the whole prompt is computed)
        return RequestOutput(rid, prompt, prompt_ids, [completion],
                             finished=finish is not None, metrics=request.metrics,
                             prompt_logprobs=list(prompt_logprobs) if first and prompt_logprobs
                             else None)
