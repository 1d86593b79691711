"""The executor stage: one compiled-engine call per step over the whole plan, then sampling."""

from __future__ import annotations

from inferflow.runtimes.step_inputs import EngineRow
from inferflow.sampling.sampler import Sampler, SampleRow
from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.scheduling.plan import SampledToken as SampledToken


class PlanRunner:
    """Runs a :class:`SchedulerOutput` on an engine with ``forward`` (and, for slot engines,
    ``load_blocks``/``save_blocks``; a paged engine gets plans without copies).

    Order within a step: prefix-cache loads, the forward pass, sampling, then saves of the blocks
    that became full (so their KV is complete when copied to the pool).
    """

    def __init__(self, engine: object, sampler: Sampler) -> None:
        self.engine = engine
        self.sampler = sampler

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        engine = self.engine
        self.sampler.forget(plan.finished_request_ids)
        if plan.kv_loads:
            engine.load_blocks(plan.kv_loads)  # type: ignore[attr-defined]
        sampled: dict[str, SampledToken] = {}
        if plan.chunks:
            rows = [EngineRow(c.slot, c.token_ids, c.start_pos, c.sample, c.block_table)
                    for c in plan.chunks]
            logits = engine.forward(rows)  # type: ignore[attr-defined]  # (R, V)
            masks = plan.token_bitmasks
            sample_rows = [SampleRow(c.request_id, c.sampling_params, c.num_output_tokens,
                                     masks.get(c.request_id))
                           for c in plan.chunks if c.sample]
            tokens = self.sampler.sample(logits, sample_rows)
            sampled = {row.request_id: tok for row, tok in zip(sample_rows, tokens, strict=True)}
        if plan.kv_saves:
            engine.save_blocks(plan.kv_saves)  # type: ignore[attr-defined]
        return ExecutorOutput(sampled)
