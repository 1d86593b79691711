"""A fake executor that really simulates KV *content* (token ids), so scheduling bugs change outputs.

- Each slot holds, per position, the token id whose "KV" is there (None = never written).
- Each pool block holds a tuple of ``block_size`` token ids (or None).
- ``kv_loads`` copy pool -> slot before the forward pass, ``kv_saves`` slot -> pool after it.
- A chunk writes its token ids at ``[start_pos, start_pos + len)``.
- The sampled token = a deterministic hash of the slot's content ``[0, start_pos + len)`` (greedy).

A wrong prefix copy, a missing load, a wrong ``start_pos`` or stale content from the slot's previous
owner therefore changes the output; reading a never-written position raises.

``paged=True`` simulates a paged executor instead: the pool blocks are the only KV; a chunk writes
its tokens into the blocks of its ``block_table`` and the sampled token hashes what the table's
blocks hold for ``[0, start_pos + len)``. A block shared while another request writes into it, a
table missing a block or a prefix hit on a block that was reused shows up as a changed output. ``reference_output``
is the independent oracle: the same hash applied to the sequence itself, no scheduler involved.

``window`` (a sliding-window model): the sampled token hashes only the last ``window``
positions' content ``[n - window, n)``, what a query at ``n - 1`` sees. A paged table's entries
for those positions (and for every position a chunk's queries see) must be real blocks: the
null block (id ``num_blocks``, the freed entries' target) holds nothing and is never written.

A chunk with drafts (speculative decoding) is verified as a real executor does it: the token at
each of its last ``len(drafts) + 1`` positions is the hash of the KV up to there, drafts are
accepted while they equal it, and the first mismatch (or the token after the last draft) is the
sampled one. Rejected drafts' KV stays written, so a scheduler that forgets to roll the length
back reads it and changes the output.

Prompt logprobs (a chunk with ``prompt_logprob_ids``): the entry of the token at position
``p + 1`` has logprob ``-next_token(KV content [0, p + 1))``, read like a sampled token
(``reference_prompt_logprobs`` is the oracle).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.layout import window_blocks
from inferflow.scheduling.plan import ExecutorOutput, SampledToken, ScheduledChunk, SchedulerOutput


def next_token(kv_content: Sequence[int], vocab_size: int) -> int:
    digest = hashlib.blake2b(array("q", kv_content).tobytes(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % vocab_size


def visible_from(n: int, window: int | None) -> int:
    """First position a query at ``n - 1`` sees: ``(n - 1) - window < j``."""
    return 0 if window is None else max(0, n - window)


def reference_prompt_logprobs(prompt: Sequence[int], vocab_size: int) -> list[float | None]:
    """The fake's prompt logprobs of ``prompt`` (first None), no scheduler involved."""
    return [None] + [-float(next_token(prompt[:i], vocab_size)) for i in range(1, len(prompt))]


def prompt_entries(chunk: ScheduledChunk, read: Callable[[int], list[int | None]],
                   vocab_size: int) -> tuple[SampledToken, ...]:
    """The fake's prompt logprobs of a chunk's ``prompt_logprob_ids``."""
    entries = []
    for j, token in enumerate(chunk.prompt_logprob_ids):
        content = read(chunk.start_pos + j + 1)
        assert None not in content, f"{chunk.request_id}: reads unwritten KV positions"
        entries.append(SampledToken(token, -float(next_token(content, vocab_size))))  # type: ignore[arg-type]
    return tuple(entries)


def reference_output(
    prompt: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int],
    max_model_len: int,
    vocab_size: int,
    window: int | None = None,
) -> list[int]:
    """What a correct scheduler + this executor must produce for one request, however batched."""
    tokens, out = list(prompt), []
    while True:
        tok = next_token(tokens[visible_from(len(tokens), window):], vocab_size)
        tokens.append(tok)
        out.append(tok)
        stop_ok = len(out) >= params.min_tokens
        if stop_ok and (
            (not params.ignore_eos and tok in eos_token_ids) or tok in params.stop_token_ids
        ):
            return out
        if len(out) >= params.max_tokens or len(tokens) >= max_model_len:
            return out


@dataclass
class StepRecord:
    step_id: int
    rows: dict[str, tuple[int, int, bool]]  # request id -> (start_pos, num tokens, sample)
    num_loads: int
    num_saves: int


@dataclass
class FakeExecutor:
    max_slots: int
    capacity: int  # = max_model_len
    num_blocks: int
    block_size: int
    vocab_size: int = 64
    paged: bool = False
    window: int | None = None
    slots: list[list[int | None]] = field(init=False)
    pool: list[tuple[int, ...] | None] = field(init=False)
    history: list[StepRecord] = field(default_factory=list)
    plans: list[SchedulerOutput] = field(default_factory=list)
    _owner: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.slots = [[None] * self.capacity for _ in range(self.max_slots)]
        self.pool = [None] * self.num_blocks

    def execute(self, plan: SchedulerOutput) -> ExecutorOutput:
        if self.paged:
            return self._execute_paged(plan)
        self._check_plan(plan)
        self.plans.append(plan)
        self._forget(plan.finished_request_ids)
        for chunk in plan.chunks:
            if self._owner.get(chunk.slot) != chunk.request_id:  # new owner: old content is garbage
                self._owner[chunk.slot] = chunk.request_id
                self.slots[chunk.slot] = [None] * self.capacity
        bs = self.block_size
        for load in plan.kv_loads:
            content = self.pool[load.block_id]
            assert content is not None, f"load of never-saved block {load.block_id}"
            self.slots[load.slot][load.block_index * bs : (load.block_index + 1) * bs] = list(
                content
            )
        sampled, accepted, prompt = {}, {}, {}
        for chunk in plan.chunks:
            kv = self.slots[chunk.slot]
            end = chunk.start_pos + len(chunk.token_ids)
            kv[chunk.start_pos : end] = list(chunk.token_ids)
            read = lambda n, kv=kv: kv[visible_from(n, self.window):n]  # noqa: E731
            if chunk.prompt_logprob_ids:
                prompt[chunk.request_id] = prompt_entries(chunk, read, self.vocab_size)
            if chunk.sample:
                rid = chunk.request_id
                sampled[rid], accepted[rid] = self._verify(chunk, read)
        for save in plan.kv_saves:
            content = self.slots[save.slot][save.block_index * bs : (save.block_index + 1) * bs]
            assert None not in content, f"save of an incomplete block {save}"
            self.pool[save.block_id] = tuple(content)  # type: ignore[arg-type]
        self.history.append(self._record(plan))
        return ExecutorOutput(sampled, accepted, prompt)

    def _verify(
        self, chunk: ScheduledChunk, read: Callable[[int], list[int | None]]
    ) -> tuple[SampledToken, tuple[SampledToken, ...]]:
        """(the sampled token, the accepted drafts) of a sampling chunk; ``read(n)`` is the KV
        content a query at ``n - 1`` sees (positions ``[0, n)``, or the window's)."""
        drafts = chunk.draft_token_ids
        end = chunk.start_pos + len(chunk.token_ids)
        logprob = -0.5 if chunk.sampling_params.logprobs is not None else None
        accepted = []
        for j in range(len(drafts) + 1):
            content = read(end - len(drafts) + j)
            assert None not in content, f"{chunk.request_id}: reads unwritten KV positions"
            token = SampledToken(next_token(content, self.vocab_size), logprob)  # type: ignore[arg-type]
            if j == len(drafts) or token.token_id != drafts[j]:
                return token, tuple(accepted)
            accepted.append(token)
        raise AssertionError("unreachable")

    def _execute_paged(self, plan: SchedulerOutput) -> ExecutorOutput:
        assert not plan.kv_loads and not plan.kv_saves, "a paged plan copies nothing"
        self.plans.append(plan)
        bs = self.block_size
        blocks = self.paged_blocks
        sampled = {}
        null = self.num_blocks
        for chunk in plan.chunks:
            end = chunk.start_pos + len(chunk.token_ids)
            assert len(chunk.block_table) == -(-end // bs), f"{chunk.request_id}: table size"
            seen = chunk.block_table[visible_from(chunk.start_pos + 1, self.window) // bs:]
            assert null not in seen, f"{chunk.request_id}: a block its queries see was freed"
            if self.window is not None:  # the blocks behind the window were given back
                held = len(chunk.block_table) - chunk.block_table.count(null)
                bound = window_blocks(self.window, bs, len(chunk.token_ids))
                assert held <= bound, f"{chunk.request_id}: holds {held} > {bound} blocks"
            for offset, token in enumerate(chunk.token_ids):
                pos = chunk.start_pos + offset
                blocks[chunk.block_table[pos // bs]][pos % bs] = token
        accepted, prompt = {}, {}
        for chunk in plan.chunks:  # reads after every write of the step, as one forward pass
            table = chunk.block_table

            def read(n: int, table: tuple[int, ...] = table) -> list[int | None]:
                return [blocks[table[p // bs]][p % bs]
                        for p in range(visible_from(n, self.window), n)]

            if chunk.prompt_logprob_ids:
                prompt[chunk.request_id] = prompt_entries(chunk, read, self.vocab_size)
            if chunk.sample:
                rid = chunk.request_id
                sampled[rid], accepted[rid] = self._verify(chunk, read)
        self.history.append(self._record(plan))
        return ExecutorOutput(sampled, accepted, prompt)

    @property
    def paged_blocks(self) -> list[list[int | None]]:
        """The pool's blocks, then the null block (never written: its content stays None)."""
        if not hasattr(self, "_paged_blocks"):
            self._paged_blocks = [[None] * self.block_size for _ in range(self.num_blocks + 1)]
        return self._paged_blocks

    def _forget(self, request_ids: frozenset[str]) -> None:
        for slot, owner in list(self._owner.items()):
            if owner in request_ids:
                del self._owner[slot]

    def _check_plan(self, plan: SchedulerOutput) -> None:
        slots = [c.slot for c in plan.chunks]
        assert len(set(slots)) == len(slots), f"two rows in one slot: {slots}"
        assert not {c.request_id for c in plan.chunks} & plan.finished_request_ids
        for c in plan.chunks:
            assert 0 <= c.slot < self.max_slots and len(c.token_ids) >= 1
            assert c.start_pos + len(c.token_ids) <= self.capacity, (
                f"{c.request_id} overflows its slot"
            )
        assert {copy.slot for copy in plan.kv_loads} <= set(slots), (
            "load into a slot that does not run"
        )

    @staticmethod
    def _record(plan: SchedulerOutput) -> StepRecord:
        rows = {c.request_id: (c.start_pos, len(c.token_ids), c.sample) for c in plan.chunks}
        return StepRecord(plan.step_id, rows, len(plan.kv_loads), len(plan.kv_saves))
