"""The executor stage: one compiled-engine call per step over the whole plan, then sampling."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from inferflow.runtimes.step_inputs import EngineRow
from inferflow.sampling.prompt_logprobs import prompt_logprobs
from inferflow.sampling.rejection import verify_drafts
from inferflow.sampling.sampler import Sampler, SampleRow
from inferflow.scheduling.plan import ExecutorOutput, KVBlockCopy, ScheduledChunk, SchedulerOutput
from inferflow.scheduling.plan import SampledToken as SampledToken

if TYPE_CHECKING:
    from inferflow.lora.slots import LoraSlots


def engine_rows(chunks: Sequence[ScheduledChunk],
                lora_slot: Mapping[str, int] | None = None) -> list[EngineRow]:
    """The engine's view of a plan's chunks (a row with drafts wants logits for each of them, a
    chunk with prompt logprobs for every token); ``lora_slot`` maps each chunk's adapter
    (``ScheduledChunk.lora``) to its engine slot (a base-model row: -1)."""
    slots = lora_slot or {}
    return [EngineRow(c.slot, c.token_ids, c.start_pos, c.sample, c.block_table, c.num_logits,
                      bool(c.prompt_logprob_ids),
                      -1 if c.lora is None else slots[c.lora]) for c in chunks]


def sample_plan(sampler: Sampler, plan: SchedulerOutput, logits: np.ndarray) -> ExecutorOutput:
    """Sample every chunk with ``sample`` from ``logits`` (each chunk's ``logits_count`` rows, in
    chunk order; a chunk samples from its last ``num_logits``): plain rows in one batched call,
    rows with drafts through verification; chunks with ``prompt_logprob_ids`` get their prompt
    logprobs from their leading rows."""
    masks = plan.token_bitmasks
    # (start, end) of each chunk's rows in ``logits``
    ends = np.cumsum([c.logits_count for c in plan.chunks])
    spans = {c.request_id: (int(e) - c.logits_count, int(e))
             for c, e in zip(plan.chunks, ends, strict=True)}
    prompt = {c.request_id: prompt_logprobs(logits[spans[c.request_id][0]:], c.prompt_logprob_ids,
                                            c.sampling_params.prompt_logprobs or 0)
              for c in plan.chunks if c.prompt_logprob_ids}
    sampling = [c for c in plan.chunks if c.sample]
    rows = [SampleRow(c.request_id, c.sampling_params, c.num_output_tokens,
                      masks.get(c.request_id), c.history) for c in sampling]
    firsts = [spans[c.request_id][1] - c.num_logits for c in sampling]  # first sampling row each
    plain = [i for i, c in enumerate(sampling) if not c.draft_token_ids]
    sampled: dict[str, SampledToken] = {}
    accepted: dict[str, tuple[SampledToken, ...]] = {}
    if plain:
        # (no prompt logprobs and no drafts: the logits are the sampling rows, in order)
        picked = logits if len(plain) == len(logits) else logits[[firsts[i] for i in plain]]
        tokens = sampler.sample(picked, [rows[i] for i in plain])
        sampled = {rows[i].request_id: tok for i, tok in zip(plain, tokens, strict=True)}
    for i, chunk in enumerate(sampling):
        if chunk.draft_token_ids:
            out = verify_drafts(sampler, logits[firsts[i]:firsts[i] + chunk.num_logits], rows[i],
                                chunk.draft_token_ids)
            sampled[chunk.request_id], accepted[chunk.request_id] = out[-1], tuple(out[:-1])
    return ExecutorOutput(sampled, accepted, prompt)


class Runner(Protocol):
    """A model runner: one forward pass over a step's rows (``TorchRunner``: paged KV)."""

    def forward(self, rows: Sequence[EngineRow]) -> np.ndarray:
        """Logits ``(R, V)``: each row's ``logits_count`` rows (its last tokens'), in row order."""
        ...


@runtime_checkable
class SlotRunner(Runner, Protocol):
    """A runner with KV slots beside the block pool (``OnnxRuntimeRunner``, ``TensorRTRunner``):
    prefix-cache hits are copied pool -> slot, full blocks slot -> pool."""

    def load_blocks(self, copies: Sequence[KVBlockCopy]) -> None: ...
    def save_blocks(self, copies: Sequence[KVBlockCopy]) -> None: ...


class PlanRunner:
    """Runs a :class:`SchedulerOutput` on a :class:`Runner` (a paged one gets plans without
    copies; a plan with copies needs a :class:`SlotRunner`).

    Order within a step: prefix-cache loads, the forward pass, sampling, then saves of the blocks
    that became full (so their KV is complete when copied to the pool).

    Multi-LoRA: ``lora_slots`` (the engine's, set once it is built) makes the adapters of each
    plan's chunks resident in the runner's slots before the forward pass, and each row carries
    its adapter's slot (``EngineRow.lora_slot``). A plan with adapters needs it.
    ``lora_running`` (the scheduler's running adapters): their slots are not given to another
    adapter even in a step they sit out.
    """

    def __init__(self, runner: Runner, sampler: Sampler, lora_slots: LoraSlots | None = None,
                 lora_running: Callable[[], Collection[str]] | None = None) -> None:
        self.runner = runner
        self.sampler = sampler
        self.lora_slots = lora_slots
        self.lora_running = lora_running

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        self.sampler.forget(plan.finished_request_ids)
        if plan.kv_loads:
            self._slots().load_blocks(plan.kv_loads)
        output = ExecutorOutput()
        if plan.chunks:
            logits = self.runner.forward(engine_rows(plan.chunks, self._assign_lora(plan)))  # (R, V)
            output = sample_plan(self.sampler, plan, logits)
        if plan.kv_saves:
            self._slots().save_blocks(plan.kv_saves)
        return output

    def _assign_lora(self, plan: SchedulerOutput) -> dict[str, int]:
        """Each adapter of the plan's chunks -> its engine slot (loaded now where it is not
        resident; the scheduler keeps a plan within ``max_loras`` adapters)."""
        names = {c.lora for c in plan.chunks if c.lora is not None}
        if not names:
            return {}
        if self.lora_slots is None:
            raise ValueError(f"a plan with LoRA adapters ({', '.join(sorted(names))}) on an "
                             "engine built without LoRA")
        running = self.lora_running() if self.lora_running is not None else ()
        return self.lora_slots.assign(names, running)

    def _slots(self) -> SlotRunner:
        if not isinstance(self.runner, SlotRunner):
            raise TypeError(f"{type(self.runner).__name__} has no KV slots: a paged runner gets "
                            "plans without block copies")
        return self.runner
