"""The one dataclass the scheduler hands to the executor each step, and what comes back.

Engine loop (see ``inferflow/engine/step.py``)::

    plan = scheduler.schedule()          # SchedulerOutput
    out = executor.execute(plan)         # ExecutorOutput
    finished = scheduler.update(plan, out)

Invariants the scheduler guarantees for a plan:
- every ``ScheduledChunk.slot`` is distinct (one row per running sequence per step);
- ``chunk.start_pos`` equals the number of tokens whose KV is already in that slot, so the
  chunk's tokens occupy positions ``[start_pos, start_pos + len(token_ids))`` and
  ``start_pos + len(token_ids) <= engine capacity``;
- slot layout: ``kv_loads`` run before the forward pass (prefix-cache hits: pool block -> slot),
  ``kv_saves`` after it (blocks that became full this step: slot -> pool), so a block saved in
  step N can be loaded by another request from step N+1 on;
- paged layout (``KVLayout.paged``): no copies (``kv_loads`` and ``kv_saves`` are empty); each
  chunk's ``block_table`` lists the physical blocks holding positions ``[0, start_pos +
  len(token_ids))``, block ``i`` holding positions ``[i * block_size, (i + 1) * block_size)``.
  The chunk writes its new KV into those blocks; a block shared with another sequence (a prefix
  hit, refcount > 1) is full and only read.

Speculative decoding: a decode chunk may end in ``draft_token_ids`` (``token_ids`` = the last
sampled token + the drafts). The executor computes KV for all of them, verifies the drafts
(``inferflow.sampling.rejection``) and reports the accepted ones in
``ExecutorOutput.accepted_drafts``; the scheduler then moves the KV length back past the
rejected ones (their KV is garbage that the next step overwrites). Positions and blocks cover
the drafts too; ``kv_saves`` (and paged prefix-cache registration) only ever cover blocks that
are full without them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from inferflow.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np


@dataclass(frozen=True)
class KVBlockCopy:
    """Copy one block of ``block_size`` tokens between a slot and the KV block pool.

    Positions covered in the slot: ``[block_index * block_size, (block_index + 1) * block_size)``.
    """

    slot: int
    block_index: int  # index of the block within the sequence (position // block_size)
    block_id: int  # physical block id in the pool


class TokenHistory(NamedTuple):
    """The tokens before the position a row samples, for the logits processors (penalties).

    ``prompt`` and ``output`` are the request's own lists (``Request.prompt_token_ids`` and
    ``output_token_ids``), not copies: O(1) per row however long the sequence. That is sound
    because the executor reads them within the step (schedule -> execute -> update, under the
    engine's lock) and only ``Scheduler.update`` appends, after sampling; a preempted request
    keeps its output, so its history is right when it resumes. ``accepted``: drafts accepted
    earlier in the same step (speculative verification, position ``j`` sees ``drafts[:j]``);
    never carried by the plan itself.
    """

    prompt: Sequence[int]
    output: Sequence[int]
    accepted: tuple[int, ...] = ()

    def output_ids(self) -> list[int]:
        """Every token generated before the sampled position."""
        return [*self.output, *self.accepted]

    def all_ids(self) -> list[int]:
        """Prompt and generated tokens before the sampled position."""
        return [*self.prompt, *self.output, *self.accepted]


@dataclass(frozen=True)
class ScheduledChunk:
    """One row of an engine step: a prefill chunk or a single decode token of one request."""

    request_id: str
    slot: int
    token_ids: tuple[int, ...]  # tokens whose KV this step computes (len >= 1)
    start_pos: int  # tokens already cached in the slot == position of token_ids[0]
    sample: bool  # True when this row completes the prompt (or decodes): sample one token
    sampling_params: SamplingParams
    # tokens generated so far (excluding this step); lets samplers apply penalties / min_tokens
    num_output_tokens: int = 0
    # paged layout only: the sequence's physical KV blocks, in position order (see module doc)
    block_table: tuple[int, ...] = ()
    # speculative decoding: the proposer's guesses, the last len(draft_token_ids) of token_ids
    # (a decode row: sample is True); the executor returns logits for 1 + len(drafts) positions
    draft_token_ids: tuple[int, ...] = ()
    # prompt logprobs (a request with ``SamplingParams.prompt_logprobs``, before its first
    # token): the prompt tokens that follow each of ``token_ids``, those at positions
    # ``start_pos + 1 ...`` (as many as ``token_ids``, one fewer in the prompt's last chunk).
    # The executor returns their logprobs in ``ExecutorOutput.prompt_logprobs``; the logits of
    # position j give the logprob of token j + 1.
    prompt_logprob_ids: tuple[int, ...] = ()
    # rows that sample: the request's prompt and output so far (references, see TokenHistory)
    history: TokenHistory | None = None
    # multi-LoRA: the adapter this request runs with (None: the base model); the executor maps
    # it to one of its slots (``inferflow.lora.slots``). A plan mixes at most ``max_loras``.
    lora: str | None = None

    @property
    def num_logits(self) -> int:
        """Positions whose next-token logits this row samples from: its drafts + 1 when it
        samples (the last ``num_logits`` of the row's ``logits_count``)."""
        return 1 + len(self.draft_token_ids) if self.sample else 0

    @property
    def logits_count(self) -> int:
        """Positions whose logits the engine returns: every token of a chunk with
        ``prompt_logprob_ids``, else ``num_logits``."""
        return len(self.token_ids) if self.prompt_logprob_ids else self.num_logits


@dataclass(frozen=True)
class SchedulerOutput:
    """Everything the executor needs for one step; built by ``Scheduler.schedule()``."""

    chunks: tuple[ScheduledChunk, ...]
    kv_loads: tuple[KVBlockCopy, ...] = ()
    kv_saves: tuple[KVBlockCopy, ...] = ()
    # requests that finished or were cancelled/preempted since the last plan: the executor drops
    # any per-request state (e.g. seeded RNGs) it keeps for them.
    finished_request_ids: frozenset[str] = frozenset()
    step_id: int = 0
    # the subset of finished_request_ids that was preempted: back to waiting, output kept
    preempted_request_ids: frozenset[str] = frozenset()
    # structured output: for each constrained request sampling in this step, its allowed tokens
    # as a packed bitmask row ((ceil(V/32),) int32, bit t%32 of word t//32; inferflow.guided.
    # bitmask). The executor's sampler must sample those requests among the allowed tokens only.
    token_bitmasks: Mapping[str, np.ndarray] = field(default_factory=dict)
    guided_mask_s: float = 0.0  # time the guided stage took to fill token_bitmasks (telemetry)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class SampledToken:
    """The token sampled for one request in one step."""

    token_id: int
    logprob: float | None = None  # log-probability of token_id (when logprobs were requested)
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    grammar_complete: bool = False  # the request's grammar allows nothing more: it ends ("stop")


@dataclass(frozen=True)
class ExecutorOutput:
    """Result of one engine step: a sampled token per chunk that had ``sample=True``, and the
    prompt logprobs of the chunks that asked (``prompt_logprob_ids``).

    With drafts, a request's new tokens are ``accepted_drafts[rid] + (sampled[rid],)``: the
    drafts the target accepted (a prefix of the chunk's ``draft_token_ids``), then its own token
    (the replacement of the first rejected draft, or the one after the last accepted).
    """

    sampled: dict[str, SampledToken] = field(default_factory=dict)
    accepted_drafts: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)
    # chunks with ``prompt_logprob_ids``: one entry per id, in order (logprob and top-k)
    prompt_logprobs: dict[str, tuple[SampledToken, ...]] = field(default_factory=dict)

    def new_tokens(self, request_id: str) -> tuple[SampledToken, ...]:
        """Every token ``request_id`` got this step, in order (empty if it sampled nothing)."""
        last = self.sampled.get(request_id)
        return () if last is None else (*self.accepted_drafts.get(request_id, ()), last)
