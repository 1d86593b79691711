"""Continuous / static / no batching over a block-accounted KV cache with chunked prefill.

One step (``schedule``), under a budget of ``max_num_batched_tokens``:

0. **priority preemption** (``policy=priority`` only; ``scheduling/priority.py``): lower-priority
   running requests make room for a waiting request that outranks them;
1. **decodes**: every running request whose prompt is done gets its one token, in service order;
   if its next block cannot be allocated, the last running request in service order that is not yet
   scheduled this step is preempted (possibly itself);
2. **continuing prefills**: running requests still prefilling get a chunk of the remaining budget,
   shrunk to the free memory (preempting only requests behind them; otherwise they wait a step);
3. **admission** (skipped in a step that preempted for memory, and in ``static`` mode once the
   batch closed):
   waiting requests in queue order, while a slot, ``max_running`` and blocks for the first chunk
   allow; prefix hits become ``kv_loads`` and only the rest is prefilled.

With a paged layout (``layout.paged``) the block ids are the executor's physical blocks: each
chunk carries its block table, a prefix hit shares the cached blocks (refcount, no copy) and a
block that became full is registered in the prefix cache once the step ran, with nothing copied.
The number of running sequences is then bounded by free blocks and ``max_num_seqs`` only.
Under a sliding window (``layout.freeing_window``) each step first frees the blocks no running
request's next chunk sees (``KVCacheManager.free_outside_window``): a sequence then holds at most
``window_blocks`` blocks, so more run at once, and ``check_fits`` bounds a request by that.

Multi-LoRA (``max_loras``; ``inferflow.lora``): the running requests use at most ``max_loras``
distinct adapters (the engine's slots), so every plan mixes at most that many. Admission skips
a waiting request whose adapter would be one too many (later requests may go ahead, as vLLM
does); it waits until a running request of an adapter finishes. Preemption only lowers the count.

Speculative decoding (``proposer``; ``scheduling/speculation.py``): decode rows carry drafts
within what the budget and free blocks leave every decode; ``update`` rolls rejected ones back.

Preemption is by recompute: the victim frees its slot and blocks (its saved blocks stay cached),
goes back to the front of the waiting queue with its output kept, and later re-prefills
prompt + output, which yields the same continuation.

Not thread-safe: the owner calls ``add_request`` / ``finish_requests`` between steps.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from inferflow.outputs import TokenLogprob
from inferflow.scheduling.config import Budgets, check_budgets, check_fits, max_running
from inferflow.scheduling.kv_cache_manager import KVCacheManager, PrefixHit
from inferflow.scheduling.layout import KVLayout
from inferflow.scheduling.plan import (
    ExecutorOutput,
    KVBlockCopy,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
    TokenHistory,
)
from inferflow.scheduling.policy import AdmissionOrder, SortKey
from inferflow.scheduling.priority import priority_victim
from inferflow.scheduling.request import Request, RequestStatus, check_stop
from inferflow.scheduling.slots import SlotAllocator
from inferflow.scheduling.speculation import DraftPlanner, DraftProposer
from inferflow.scheduling.updates import SchedulerStats, SpecDecodeStats, StepUpdate


@dataclass
class _Step:
    """The plan being built by one ``schedule()`` call."""

    budget: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    loads: list[KVBlockCopy] = field(default_factory=list)
    saves: list[KVBlockCopy] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)
    preempted: bool = False
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # proposed this step


class Scheduler:
    """``budgets`` (the ``batching`` stage, or a ``SchedulerConfig``) bound what runs per step on
    the frozen ``layout``; ``policy`` orders admission and preemption (default: ``budgets``);
    ``kv`` is the block accounting and prefix cache (default: a ``KVCacheManager`` over the
    layout's pool, prefix caching on); ``proposer`` drafts tokens for speculative decoding (None:
    no speculation); ``max_loras`` caps the distinct LoRA adapters of the running requests
    (None: LoRA off, a request with ``lora`` is refused). Budgets the layout cannot honour are a
    ``SchedulerConfigError``."""

    def __init__(
        self,
        budgets: Budgets,
        layout: KVLayout,
        policy: AdmissionOrder | None = None,
        kv: KVCacheManager | None = None,
        proposer: DraftProposer | None = None,
        clock: Callable[[], float] = time.time,
        max_loras: int | None = None,
    ) -> None:
        check_budgets(budgets, layout)
        if max_loras is not None and max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {max_loras}")
        self.max_loras = max_loras
        self._running_loras: Counter[str] = Counter()  # adapter -> running requests using it
        self.budgets, self.layout = budgets, layout
        self.max_running = max_running(budgets, layout)
        self.drafts = None if proposer is None else DraftPlanner(proposer, layout.max_model_len)
        self.policy = policy or budgets
        sizes = (layout.num_blocks, layout.block_size, layout.freeing_window)
        self.kv = kv or KVCacheManager(sizes[0], sizes[1], True, sizes[2])
        if (self.kv.pool.num_blocks, self.kv.block_size, self.kv.window) != sizes:
            raise ValueError("kv: its pool does not match the layout's blocks, size or window")
        self.slots = SlotAllocator(layout.max_slots)
        self._clock = clock
        self._keys: dict[str, SortKey] = {}  # live request id -> service-order key
        self.waiting = self.policy.make_queue(self._keys)
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}  # live (unfinished) requests
        self._to_report: set[str] = set()  # finished/preempted since the last plan
        self._preempted: set[str] = set()  # ... of which preempted
        self._seq = itertools.count()
        self._batch_open = True  # static mode: may the current batch still admit?
        self._num_steps = 0
        self._num_preemptions = 0
        self._num_scheduled_tokens = 0
        # paged: blocks that became full in a planned step, registered when it ran (step id ->)
        self._uncommitted: dict[int, list[KVBlockCopy]] = {}

    # -- requests in and out ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a fresh request. Raises ValueError if it could never run under this config."""
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} is already queued or running")
        if (
            request.status != RequestStatus.WAITING
            or request.num_computed_tokens
            or request.output_token_ids
        ):
            raise ValueError(f"request {request.request_id!r} is not fresh")
        if request.lora is not None and self.max_loras is None:
            raise ValueError(f"request {request.request_id!r}: LoRA adapter {request.lora!r} "
                             "but this engine serves no adapters")
        check_fits(request, self.layout, self.budgets)
        self._requests[request.request_id] = request
        self._keys[request.request_id] = self.policy.sort_key(request, next(self._seq))
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: Iterable[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED
    ) -> list[Request]:
        """Finish live requests from outside (cancel, timeout, stop string): their slot and blocks
        are freed now, and the executor hears of it in the next plan. Unknown ids are ignored."""
        if not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status!r}")
        done = []
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self._finish(request, status, None)
                done.append(request)
        return done

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- schedule ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.budgets.max_num_batched_tokens)
        if str(self.budgets.policy) == "priority":
            self._preempt_for_priority(step)
        self._schedule_running(step)
        if not step.preempted and self._admission_open():
            self._schedule_waiting(step)
        self._num_steps += 1
        self._num_scheduled_tokens += self.budgets.max_num_batched_tokens - step.budget
        reported, self._to_report = frozenset(self._to_report), set()
        preempted, self._preempted = frozenset(self._preempted & reported), set()
        if self.layout.paged:  # nothing to copy: the blocks are registered after the step
            self._uncommitted = {self._num_steps: step.saves} if step.saves else {}
            step.loads, step.saves = [], []
        return SchedulerOutput(
            chunks=tuple(step.chunks),
            kv_loads=tuple(step.loads),
            kv_saves=tuple(step.saves),
            finished_request_ids=reported,
            step_id=self._num_steps,
            preempted_request_ids=preempted,
        )

    def _schedule_running(self, step: _Step) -> None:
        for request in self.running:  # (nothing before the next query's window is read again)
            self.kv.free_outside_window(request.request_id, request.num_computed_tokens)
        order = sorted(self.running, key=self._key)
        decodes = [r for r in order if r.num_tokens_to_compute == 1]
        if self.drafts is not None:
            step.drafts = self.drafts.propose(decodes)
        for i, request in enumerate(decodes):
            if request.status == RequestStatus.RUNNING and step.budget > 0:
                self._schedule_decode(request, step, later=len(decodes) - i - 1)
        for request in [r for r in order if r.num_tokens_to_compute > 1]:
            if request.status == RequestStatus.RUNNING and step.budget > 0:
                self._schedule_prefill(request, step)

    def _schedule_decode(self, request: Request, step: _Step, later: int = 0) -> None:
        """``later`` decodes follow: drafts leave each a token of budget and a block (no starving)."""
        while not self.kv.can_grow(request.request_id, request.num_computed_tokens + 1):
            victim = self._pick_victim(step, behind=None)
            assert victim is not None  # `request` itself is always a candidate
            self._preempt(victim, step)
            if victim is request:
                return
        drafts = step.drafts.get(request.request_id, ())
        if drafts:  # as many as the budget and the free blocks allow, never by preempting
            fit = self.kv.max_tokens_fitting(request.request_id, reserved=later)
            drafts = DraftPlanner.clip(drafts, step.budget - later,
                                       fit - request.num_computed_tokens - 1)
        self._emit_chunk(request, 1, step, drafts)

    def _schedule_prefill(self, request: Request, step: _Step) -> None:
        n = self._chunk_size(request.num_tokens_to_compute, step.budget)
        while n > 0:
            fit = self.kv.max_tokens_fitting(request.request_id) - request.num_computed_tokens
            if fit >= n or (fit > 0 and self.budgets.enable_chunked_prefill):
                self._emit_chunk(request, min(n, fit), step)
                return
            victim = self._pick_victim(step, behind=request)
            if victim is None:
                return  # keep its blocks, try again next step
            self._preempt(victim, step)

    def _admission_open(self) -> bool:
        if self.budgets.mode != "static":
            return True
        if not self.running:
            self._batch_open = True
        return self._batch_open

    def _schedule_waiting(self, step: _Step) -> None:
        """Admit in queue order; stop at the first request that does not fit (no overtaking)."""
        while (
            self.waiting
            and step.budget > 0
            and len(self.running) < self.max_running
            and self.slots.num_free
        ):
            # (a request waiting for its prompt leader, or whose adapter would exceed
            # max_loras, is passed over, blocking nobody)
            request = next((r for r in self.waiting if not self._waits_for_leader(r)
                            and self._lora_admissible(r)), None)
            if request is None:
                break
            if request.request_id in self._preempted:
                break  # preempted for priority this step: it is reported, not run, this step
            hit = self._prefix_hit(request)
            n = self._chunk_size(request.num_tokens - hit.num_tokens, step.budget)
            if n == 0:
                return  # budget too small for an unchunked prompt: next step, batch stays open
            if not self.kv.can_admit(hit, hit.num_tokens + n):
                break
            self.waiting.remove(request)
            self._admit(request, hit, n, step)
        if step.budget > 0:  # static mode: stopped by seqs/slots/memory/queue, not by the budget
            self._batch_open = False

    def _lora_admissible(self, request: Request) -> bool:
        """Running ``request`` keeps the distinct adapters of the running requests within
        ``max_loras`` (the base model and an adapter already running always fit)."""
        return (request.lora is None or self.max_loras is None
                or request.lora in self._running_loras
                or len(self._running_loras) < self.max_loras)

    @property
    def running_loras(self) -> set[str]:
        """The adapters of the running requests (at most ``max_loras``)."""
        return set(self._running_loras)

    def live_loras(self) -> set[str]:
        """The adapters of every live request, waiting or running."""
        return {r.lora for r in self._requests.values() if r.lora is not None}

    def _prefix_hit(self, request: Request) -> PrefixHit:
        """The cached prefix ``request`` reuses: none while it computes prompt logprobs (a
        cached position has no logits; its own blocks are still cached for others)."""
        if request.computes_prompt_logprobs:
            return PrefixHit((), 0)
        return self.kv.find_prefix(request.all_token_ids, request.cache_extra_keys)

    def _waits_for_leader(self, request: Request) -> bool:
        """n > 1: ``request`` shares its prompt with ``prompt_leader``, which has not computed it
        yet (waiting, prefilling, or its last prompt chunk in a step that has not run: it has no
        token). Once it has, the prompt's full blocks are prefix-cache hits. A leader that
        finished or is unknown, or no prefix cache, or a request computing prompt logprobs (no
        hits): no wait."""
        if (request.prompt_leader is None or not self.kv.enable_prefix_caching
                or request.computes_prompt_logprobs):
            return False
        leader = self._requests.get(request.prompt_leader)
        return leader is not None and leader is not request and leader.num_output_tokens == 0

    def _admit(self, request: Request, hit: PrefixHit, n: int, step: _Step) -> None:
        slot = self.slots.allocate()
        rid = request.request_id
        step.loads += self.kv.admit(rid, hit, hit.num_tokens + n, slot, request.cache_extra_keys)
        self.kv.record_lookup(request.num_tokens, hit)
        request.slot, request.status = slot, RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_tokens
        if request.lora is not None:
            self._running_loras[request.lora] += 1
            assert self.max_loras is None or len(self._running_loras) <= self.max_loras
        if request.metrics.first_scheduled_time is None:
            request.metrics.first_scheduled_time = self._clock()
            request.metrics.num_cached_prompt_tokens = min(
                hit.num_tokens, request.num_prompt_tokens
            )
        self.running.append(request)
        self._emit_chunk(request, n, step)

    def _chunk_size(self, remaining: int, budget: int) -> int:
        """Tokens of a prefill to compute this step; 0 if it must wait (unchunked and too long)."""
        budgets = self.budgets
        if not budgets.enable_chunked_prefill:
            return remaining if remaining <= budget else 0
        n = min(remaining, budget)
        if budgets.long_prefill_token_threshold:
            n = min(n, budgets.long_prefill_token_threshold)
        return n

    def _emit_chunk(
        self, request: Request, n: int, step: _Step, drafts: tuple[int, ...] = ()
    ) -> None:
        """Schedule ``all_token_ids[num_computed : num_computed + n]`` of a running request, then
        ``drafts`` (a decode's guesses: KV positions and blocks for them too, until ``update``)."""
        start, end = request.num_computed_tokens, request.num_computed_tokens + n
        assert request.slot is not None and end <= request.num_tokens
        assert 0 < n + len(drafts) <= step.budget
        rid = request.request_id
        self.kv.grow(rid, end + len(drafts))
        table = tuple(self.kv.block_ids(rid)) if self.layout.paged else ()
        prompt_ids: tuple[int, ...] = ()  # prompt logprobs: the tokens positions start.. predict
        if request.computes_prompt_logprobs:
            prompt_ids = request.token_slice(start + 1, min(end + 1, request.num_prompt_tokens))
            assert not (prompt_ids and drafts)  # (drafts follow a sampled token only)
        sample = end == request.num_tokens and request.sampling_params.max_tokens > 0
        # a row that samples sees its prompt and output (two references: O(1), see TokenHistory)
        history = TokenHistory(request.prompt_token_ids, request.output_token_ids) if sample else None
        step.chunks.append(
            ScheduledChunk(
                request_id=rid,
                slot=request.slot,
                token_ids=request.token_slice(start, end) + drafts,
                start_pos=start,
                # max_tokens 0: the prompt is computed, nothing is sampled
                sample=sample,
                sampling_params=request.sampling_params,
                num_output_tokens=request.num_output_tokens,
                block_table=table,
                draft_token_ids=drafts,
                prompt_logprob_ids=prompt_ids,
                history=history,
                lora=request.lora,
            )
        )
        step.saves += self.kv.take_saves(rid, request.all_token_ids, end, request.slot)
        request.num_computed_tokens = end  # (+ the accepted drafts, in update)
        step.budget -= n + len(drafts)
        step.scheduled.add(rid)

    # -- preemption ----------------------------------------------------------------------------
    def _key(self, request: Request) -> SortKey:
        return self._keys[request.request_id]

    def _pick_victim(self, step: _Step, behind: Request | None) -> Request | None:
        """Last running request in service order not scheduled this step (strictly behind ``behind``)."""
        candidates = [
            r
            for r in self.running
            if r.request_id not in step.scheduled
            and (behind is None or self._key(r) > self._key(behind))
        ]
        return max(candidates, key=self._key, default=None)

    def _preempt_for_priority(self, step: _Step) -> None:
        """Preempt lower-priority running requests, lowest first, while the waiting head outranks
        them and lacks a slot or the blocks of its first chunk (``scheduling/priority.py``)."""
        if not self.waiting or not self._admission_open():
            return
        head = self.waiting.peek()
        if not self._lora_admissible(head):
            return  # (its adapter waits for a running one's requests to end, not for room)
        while not self._head_fits(head):
            victim = priority_victim(head, self.running, self._key)
            if victim is None:
                return
            self._preempt(victim, step)
            step.preempted = False  # room made for the head: admission follows this step

    def _head_fits(self, head: Request) -> bool:
        """A slot and the blocks for ``head``'s first chunk, with the budget the running decodes
        leave (a prompt the budget defers is no reason to preempt)."""
        if len(self.running) >= self.max_running or not self.slots.num_free:
            return False
        decodes = sum(1 for r in self.running if r.num_tokens_to_compute == 1)
        hit = self.kv.find_prefix(head.all_token_ids, head.cache_extra_keys)
        n = self._chunk_size(head.num_tokens - hit.num_tokens,
                             max(1, self.budgets.max_num_batched_tokens - decodes))
        return n == 0 or self.kv.can_admit(hit, hit.num_tokens + n)

    def _preempt(self, request: Request, step: _Step) -> None:
        self._release(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.metrics.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.prepend(request)
        self._to_report.add(request.request_id)  # the executor drops its per-request state
        self._preempted.add(request.request_id)
        step.preempted = True

    def _release(self, request: Request) -> None:
        """Give back the slot and blocks of a running request (the proposer forgets it too)."""
        if self.drafts is not None:
            self.drafts.forget([request.request_id])
        self.running.remove(request)
        if request.lora is not None:
            self._running_loras[request.lora] -= 1
            if not self._running_loras[request.lora]:
                del self._running_loras[request.lora]
        self.kv.free(request.request_id)
        assert request.slot is not None
        self.slots.free(request.slot)
        request.slot = None

    def _finish(
        self, request: Request, status: RequestStatus, stop_reason: int | str | None
    ) -> None:
        if request.status == RequestStatus.RUNNING:
            self._release(request)
        else:
            self.waiting.remove(request)
        request.status, request.stop_reason = status, stop_reason
        request.metrics.finished_time = self._clock()
        del self._requests[request.request_id], self._keys[request.request_id]
        self._to_report.add(request.request_id)
        self._preempted.discard(request.request_id)  # preempted, then finished: it is gone

    # -- update ----------------------------------------------------------------------------
    def update(self, plan: SchedulerOutput, output: ExecutorOutput) -> list[StepUpdate]:
        """Apply one executed step: register saved blocks, append sampled tokens, finish stopped
        requests (freeing their blocks at once). Returns one update per request that got a token."""
        self.kv.commit_saves(plan.kv_saves)
        self.kv.commit_saves(self._uncommitted.pop(plan.step_id, ()))
        updates = []
        for chunk in plan.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished from outside since the plan was made
            if request.computes_prompt_logprobs:
                self._record_prompt_logprobs(request, chunk, output)
            if not chunk.sample:
                if request.sampling_params.max_tokens == 0 and not request.num_tokens_to_compute:
                    updates.append(self._finish_prompt_only(request))
                continue  # a prefill chunk
            tokens = output.new_tokens(chunk.request_id)
            if not tokens:
                raise ValueError(f"executor returned no token for request {chunk.request_id!r}")
            if chunk.draft_token_ids and self.drafts is not None:
                self.drafts.roll_back(request, chunk, tokens, self.kv)
            updates.append(self._apply_sample(request, tokens))
        return updates

    @staticmethod
    def _record_prompt_logprobs(request: Request, chunk: ScheduledChunk,
                                output: ExecutorOutput) -> None:
        """Keep the prompt logprobs a chunk of ``request`` got (tokens ``start_pos + 1 ...``)."""
        logprobs: list[TokenLogprob] = []
        if chunk.prompt_logprob_ids:
            entries = output.prompt_logprobs.get(chunk.request_id, ())
            logprobs = [TokenLogprob(e.token_id, e.logprob, list(e.top_logprobs))
                        for e in entries if e.logprob is not None]
            if len(logprobs) != len(chunk.prompt_logprob_ids):
                raise ValueError(f"executor returned {len(logprobs)} prompt logprobs for request "
                                 f"{chunk.request_id!r}, expected {len(chunk.prompt_logprob_ids)}")
        end = chunk.start_pos + len(chunk.token_ids)
        request.record_prompt_logprobs(chunk.start_pos + 1, logprobs,
                                       complete=end >= request.num_prompt_tokens)

    def _finish_prompt_only(self, request: Request) -> StepUpdate:
        """``max_tokens`` 0: the prompt is computed (its blocks cached, its logprobs kept), the
        request ends at its length limit without a token."""
        now = self._clock()
        request.metrics.first_token_time = request.metrics.last_token_time = now
        self._finish(request, RequestStatus.FINISHED_LENGTH_CAPPED, None)
        return StepUpdate(request, (), (), request.finish_reason, None)

    def _apply_sample(self, request: Request, tokens: tuple[SampledToken, ...]) -> StepUpdate:
        """Append a step's tokens in order, stopping at the first one that ends the request."""
        now = self._clock()  # (one time for the step's tokens, before a finish stamps its own)
        if request.metrics.first_token_time is None:
            request.metrics.first_token_time = now
        request.metrics.last_token_time = now
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprob] = []
        wants_logprobs = request.sampling_params.logprobs is not None
        for sampled in tokens:
            logprob = None
            if wants_logprobs and sampled.logprob is not None:
                logprob = TokenLogprob(sampled.token_id, sampled.logprob, list(sampled.top_logprobs))
                new_logprobs.append(logprob)
            request.append_output(sampled.token_id, logprob)
            new_ids.append(sampled.token_id)
            decision = check_stop(request, self.layout.max_model_len)
            if decision is not None:
                self._finish(request, decision.status, decision.stop_reason)
            elif sampled.grammar_complete:  # structured output: nothing more may follow
                self._finish(request, RequestStatus.FINISHED_STOPPED, None)
            if request.is_finished:
                break
        return StepUpdate(request, tuple(new_ids), tuple(new_logprobs), request.finish_reason,
                          request.stop_reason)

    # -- introspection -------------------------------------------------------------------------
    @property
    def spec_stats(self) -> SpecDecodeStats:
        """Speculative decoding since start (all zero without a proposer)."""
        return self.drafts.stats if self.drafts is not None else SpecDecodeStats()

    @property
    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_kv_blocks_total=pool.num_blocks,
            num_kv_blocks_used=pool.num_used_blocks,
            num_kv_blocks_free=pool.num_free_blocks,
            num_kv_blocks_cached=pool.num_cached_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self._num_preemptions,
            num_steps=self._num_steps,
            num_scheduled_tokens=self._num_scheduled_tokens,
            running_loras=tuple(sorted(self._running_loras)),
            waiting_loras=tuple(sorted({r.lora for r in self.waiting if r.lora is not None})),
            max_loras=self.max_loras or 0,
        )
