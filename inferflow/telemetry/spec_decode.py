"""Speculative decoding telemetry: what one step's drafts did, as metrics and span attributes.

Metric names are vLLM's (``vllm:spec_decode_*``; counters gain ``_total`` when exposed): drafts
(decode rows that carried drafts), draft tokens, accepted tokens, accepted tokens per draft
position, and tokens emitted by those rows; two gauges since start: the acceptance rate
(accepted / draft tokens) and the mean accepted length (tokens per speculative row and step,
1 + accepted / drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from inferflow.scheduling.plan import ExecutorOutput, SchedulerOutput
from inferflow.telemetry import attributes as A


@dataclass(frozen=True)
class StepSpecDecode:
    """One step's speculative rows (all zero for a step without drafts)."""

    num_drafts: int = 0  # rows with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # rows whose i-th draft was accepted

    @classmethod
    def of(cls, plan: SchedulerOutput, output: ExecutorOutput) -> StepSpecDecode:
        rows = [(len(c.draft_token_ids), len(output.accepted_drafts.get(c.request_id, ())))
                for c in plan.chunks if c.draft_token_ids and c.request_id in output.sampled]
        if not rows:
            return cls()
        per_pos = [0] * max(k for k, _ in rows)
        for _, accepted in rows:
            for i in range(accepted):
                per_pos[i] += 1
        return cls(len(rows), sum(k for k, _ in rows), sum(a for _, a in rows), tuple(per_pos))

    def span_attributes(self) -> dict[str, Any]:
        """The engine-step span's ``inferflow.spec_decode.*`` attributes (empty without drafts)."""
        if not self.num_drafts:
            return {}
        return {A.STEP_SPEC_NUM_DRAFTS: self.num_drafts,
                A.STEP_SPEC_NUM_DRAFT_TOKENS: self.num_draft_tokens,
                A.STEP_SPEC_NUM_ACCEPTED_TOKENS: self.num_accepted_tokens}


class SpecDecodeMetrics:
    """The ``vllm:spec_decode_*`` instruments of one engine (labels ``model_name``, ``engine``)."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, str]) -> None:
        names = ["model_name", "engine"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=registry).labels(*labels)

        def gauge(name: str, doc: str) -> Any:
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

    def on_step(self, step: StepSpecDecode) -> None:
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
