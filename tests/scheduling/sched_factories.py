"""Factories for scheduler tests: tiny configs, requests, a scheduler + fake executor harness."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from fake_executor import FakeExecutor, next_token, reference_output, visible_from

from inferflow.engine.step import step
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling import KVLayout, Request, RequestStatus, Scheduler, SchedulerConfig
from inferflow.scheduling.config import BatchingMode, check_budgets
from inferflow.scheduling.integrity import check_scheduler
from inferflow.scheduling.kv_cache_manager import KVCacheManager
from inferflow.scheduling.plan import SchedulerOutput
from inferflow.scheduling.speculation import DraftProposer, DraftRequest
from inferflow.scheduling.updates import StepUpdate

VOCAB = 64
EOS = 0

TINY = dict(
    max_num_seqs=4,
    max_num_batched_tokens=32,
    max_model_len=64,
    num_blocks=16,
    block_size=4,
    max_slots=4,
)


class FakeClock:
    def __init__(self) -> None:
        self._t = itertools.count()

    def __call__(self) -> float:
        return float(next(self._t))


@dataclass(frozen=True)
class TinyConfig:
    """A scheduler's budgets and its layout in one set of keywords (checked as the graph does)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    num_blocks: int = 512
    block_size: int = 16
    max_slots: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: str = "fcfs"
    mode: BatchingMode = "continuous"
    paged: bool = False
    sliding_window: int | None = None  # the model's (every layer's) window: the fake's and paged freeing

    def __post_init__(self) -> None:
        check_budgets(self.budgets, self.layout)

    @property
    def budgets(self) -> SchedulerConfig:
        return SchedulerConfig(
            self.max_num_seqs, self.max_num_batched_tokens, self.enable_chunked_prefill,
            self.long_prefill_token_threshold, self.policy, self.mode)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.max_slots, self.max_model_len, self.block_size, self.num_blocks,
                        self.paged, self.sliding_window)

    @property
    def max_running(self) -> int:
        return 1 if self.mode == "none" else min(self.max_num_seqs, self.max_slots)


def make_config(**overrides: object) -> TinyConfig:
    return TinyConfig(**{**TINY, **overrides})  # type: ignore[arg-type]


def make_scheduler(cfg: TinyConfig, clock: Callable[[], float] = FakeClock(),
                   proposer: DraftProposer | None = None, max_loras: int | None = None) -> Scheduler:
    kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching,
                        cfg.layout.freeing_window)
    return Scheduler(cfg.budgets, cfg.layout, kv=kv, proposer=proposer, clock=clock,
                     max_loras=max_loras)


def make_request(
    request_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int = 8,
    arrival_time: float = 0.0,
    priority: int = 0,
    lora: str | None = None,
    **params: object,
) -> Request:
    """Greedy request; EOS = token 0 (the fake's vocabulary is 0..63); ``lora``: its adapter."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)  # type: ignore[arg-type]
    return Request(
        request_id,
        list(prompt),
        sp,
        eos_token_ids=(EOS,),
        arrival_time=arrival_time,
        priority=priority,
        lora=lora,
    )


def expected(request: Request, config: TinyConfig) -> list[int]:
    """The oracle output of ``request`` (run alone, no scheduler)."""
    return reference_output(
        request.prompt_token_ids,
        request.sampling_params,
        request.eos_token_ids,
        config.max_model_len,
        VOCAB,
        config.sliding_window,
    )


@dataclass
class Harness:
    """A scheduler and a fake executor driven by ``engine_loop.step``; integrity checked every step."""

    config: TinyConfig
    proposer: DraftProposer | None = None  # speculative decoding
    max_loras: int | None = None  # multi-LoRA: the scheduler's cap on running adapters
    scheduler: Scheduler = field(init=False)
    executor: FakeExecutor = field(init=False)
    finished: dict[str, Request] = field(default_factory=dict)
    updates: list[list[StepUpdate]] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.config
        self.scheduler = make_scheduler(cfg, clock=FakeClock(), proposer=self.proposer,
                                        max_loras=self.max_loras)
        self.executor = FakeExecutor(
            cfg.max_slots, cfg.max_model_len, cfg.num_blocks, cfg.block_size, VOCAB, cfg.paged,
            cfg.sliding_window,
        )

    def add(self, *requests: Request) -> None:
        for r in requests:
            self.scheduler.add_request(r)

    def step(self) -> list[StepUpdate]:
        updates = step(self.scheduler, self.executor)
        check_scheduler(self.scheduler)
        for u in updates:
            if u.finished:
                self.finished[u.request_id] = u.request
        self.updates.append(updates)
        return updates

    def run(self, max_steps: int = 2000) -> int:
        """Step until nothing is left; returns the number of steps taken."""
        for n in itertools.count():
            if not self.scheduler.has_unfinished_requests():
                return n
            assert n < max_steps, "scheduler made no progress"
            self.step()
        raise AssertionError("unreachable")

    @property
    def last_plan(self) -> SchedulerOutput:
        return self.executor.plans[-1]

    def outputs(self) -> dict[str, list[int]]:
        return {rid: r.output_token_ids for rid, r in self.finished.items()}


def run_alone_outputs(requests: Sequence[Request], config: TinyConfig) -> dict[str, list[int]]:
    return {r.request_id: expected(r, config) for r in requests}


def clone(request: Request) -> Request:
    """A fresh copy (same id, prompt, params, arrival, priority) for a second run."""
    return Request(
        request.request_id,
        list(request.prompt_token_ids),
        request.sampling_params,
        eos_token_ids=request.eos_token_ids,
        arrival_time=request.arrival_time,
        priority=request.priority,
    )


__all__ = [
    "EOS",
    "VOCAB",
    "Harness",
    "RequestStatus",
    "clone",
    "expected",
    "make_config",
    "make_request",
]


class OracleProposer:
    """Drafts the fake executor's true continuation (under ``window``, the model's sliding
    window), each draft wrong with probability ``error_rate`` and the run cut after it, drafts of
    1..k tokens: every acceptance length occurs. Deterministic (a hash of the sequence decides),
    so a failing example replays."""

    def __init__(self, num_speculative_tokens: int = 3, error_rate: float = 0.3,
                 window: int | None = None) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.error_rate = error_rate
        self.window = window
        self.forgotten: set[str] = set()

    def propose(self, requests: Sequence[DraftRequest]) -> list[tuple[int, ...]]:
        out = []
        for r in requests:
            tokens, drafts = list(r.token_ids), []
            n = 1 + next_token([*tokens, -1], r.max_draft_tokens)  # 1..max_draft_tokens
            for j in range(n):
                true = next_token(tokens[visible_from(len(tokens), self.window):], VOCAB)
                wrong = next_token([*tokens, -2 - j], 1000) < self.error_rate * 1000
                drafts.append((true + 1) % VOCAB if wrong else true)
                tokens.append(drafts[-1])
            out.append(tuple(drafts))
        return out

    def forget(self, request_ids: Iterable[str]) -> None:
        self.forgotten.update(request_ids)
