"""Speculative decoding telemetry: what one step's drafts did, as metrics and span attributes.

Metric names are vLLM's (``vllm:spec_decode_*``; counters gain ``_total`` when exposed): drafts
(decode rows that carried drafts), draft tokens, accepted tokens, accepted tokens per draft
position, and tokens emitted by those rows; two gauges since start: the acceptance rate
(accepted / draft tokens) and the mean accepted length (tokens per speculative row and step,
1 + accepted / drafts).
"""

from __future__ import annotations

from opentelemetry.util.types import AttributeValue
from prometheus_client import CollectorRegistry, Counter, Gauge

from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.scheduling.updates import SpecDecodeStats
from inferflow.telemetry import attributes as A


def step_spec_decode(plan: SchedulerOutput, output: ExecutorOutput) -> SpecDecodeStats:
    """One step's speculative rows, counted as the scheduler counts them (all zero without)."""
    stats = SpecDecodeStats()
    for chunk in plan.chunks:
        if chunk.draft_token_ids and chunk.request_id in output.sampled:
            stats.record(len(chunk.draft_token_ids),
                         len(output.accepted_drafts.get(chunk.request_id, ())))
    return stats


def span_attributes(step: SpecDecodeStats) -> dict[str, AttributeValue]:
    """The engine-step span's ``inferflow.spec_decode.*`` attributes (empty without drafts)."""
    if not step.num_drafts:
        return {}
    return {A.STEP_SPEC_NUM_DRAFTS: step.num_drafts,
            A.STEP_SPEC_NUM_DRAFT_TOKENS: step.num_draft_tokens,
            A.STEP_SPEC_NUM_ACCEPTED_TOKENS: step.num_accepted_tokens}


class SpecDecodeMetrics:
    """The ``vllm:spec_decode_*`` instruments of one engine (labels ``model_name``, ``engine``)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str]) -> None:
        names = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(*labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry,
                         multiprocess_mode="mostrecent").labels(*labels)

        self.drafts = counter("vllm:spec_decode_num_drafts", "Decode rows that carried drafts.")
        self.draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.accepted = counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.emitted = counter("vllm:spec_decode_num_emitted_tokens",
                               "Tokens emitted by rows with drafts (accepted + one each).")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                          "Draft tokens accepted, by position in the draft (0 = first).",
                          [*names, "position"], registry=registry)
        self._per_pos = lambda i: per_pos.labels(*labels, str(i))
        self.acceptance_rate = gauge("vllm:spec_decode_draft_acceptance_rate",
                                     "Accepted / draft tokens since start.")
        self.mean_accepted_length = gauge(
            "inferflow:spec_decode_mean_accepted_length",
            "Tokens per speculative decode row and step since start (1 + accepted / drafts).")
        self._totals = [0, 0, 0]  # drafts, draft tokens, accepted (this process)

    def on_step(self, step: SpecDecodeStats) -> None:
        if not step.num_drafts:
            return
        self.drafts.inc(step.num_drafts)
        self.draft_tokens.inc(step.num_draft_tokens)
        self.emitted.inc(step.num_accepted_tokens + step.num_drafts)
        if step.num_accepted_tokens:
            self.accepted.inc(step.num_accepted_tokens)
        for i, n in enumerate(step.accepted_per_position):
            if n:
                self._per_pos(i).inc(n)
        totals = self._totals
        totals[0] += step.num_drafts
        totals[1] += step.num_draft_tokens
        totals[2] += step.num_accepted_tokens
        self.acceptance_rate.set(totals[2] / totals[1])
        self.mean_accepted_length.set(1 + totals[2] / totals[0])
