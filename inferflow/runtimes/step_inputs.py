"""Pure functions turning one step's rows into engine input arrays (testable without an engine).

A *row* is one sequence's work in a step: ``len(token_ids)`` new tokens starting at position
``start_pos`` of slot ``slot``. Rows become one or more engine *calls*; in each call every row's
padded chunk must fit its slot: ``start_pos + S <= capacity`` (S = longest chunk of the call).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EngineRow:
    slot: int
    token_ids: tuple[int, ...]
    start_pos: int
    sample: bool  # return logits of the row's last token (its last num_logits tokens)
    block_table: tuple[int, ...] = ()  # paged engines: the row's KV blocks (ScheduledChunk's)
    num_logits: int = 1  # with sample: trailing tokens whose logits come back (drafts + 1)
    # prompt logprobs: the logits of every token of the row come back, sampling or not (the
    # sampling row, if any, is the last of them)
    prompt_logits: bool = False
    # multi-LoRA: the engine slot of the row's adapter (``inferflow.lora``); -1 = the base model
    lora_slot: int = -1

    @property
    def logits_count(self) -> int:
        """Logits rows this row contributes to the engine's output: its last ``logits_count``
        tokens' (every token with ``prompt_logits``; else ``num_logits`` when it samples, 0 when
        not)."""
        if self.prompt_logits:
            return len(self.token_ids)
        return self.num_logits if self.sample else 0


@dataclass
class StepArrays:
    """Inputs of one engine call (names as in ``inferflow.models.llama_graph``)."""

    input_ids: np.ndarray  # int64 (N,)
    pad_index: np.ndarray  # int64 (B, S); N marks padding
    unpad_index: np.ndarray  # int64 (N,)
    logits_index: np.ndarray  # int64 (R,) R = the rows' logits_count summed
    seqlens_k: np.ndarray  # int32 (B,) tokens after the step - 1 (0 for idle slots)
    query_seqlens: np.ndarray  # int32 (B,) valid tokens (0 for idle slots)
    position_ids: np.ndarray  # int64 (B, S) absolute positions (canonical form)
    write_indices: np.ndarray  # int64 (B,) tokens before the step (canonical form)
    slots: np.ndarray  # int64 (B,) slot of each batch entry
    sampled_rows: list[int]  # indices into the call's rows whose logits come back, in order


def split_calls(rows: Sequence[EngineRow], capacity: int) -> list[list[int]]:
    """Group row indices into calls so that every row's padded chunk fits its slot.

    Usually one call. Longest chunks first; a row joins the first call whose chunk length S
    (its first, longest member) satisfies ``start_pos + S <= capacity``.
    """
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i].token_ids))
    calls: list[list[int]] = []
    for i in order:
        r = rows[i]
        for call in calls:
            if r.start_pos + len(rows[call[0]].token_ids) <= capacity:
                call.append(i)
                break
        else:
            calls.append([i])
    return [sorted(c) for c in calls]


PAD_RATIO = 4  # a call is split when its padded (B, S) grid is this many times its tokens


def split_padding(rows: Sequence[EngineRow], call: list[int]) -> list[list[int]]:
    """Split one call whose padded grid is mostly padding: its decode rows (one token each, or
    a token and its drafts) stay together, every prefill chunk runs alone.

    The in-place form pads a call to (B, S): B the slots from its lowest to its highest, S its
    longest chunk, so one prefill chunk beside many decodes costs B x S positions in the
    attention's gathers for S + B - 1 tokens. A separate call reads the weights once more, which
    costs less than that padding as soon as it is ``PAD_RATIO`` times the tokens.
    """
    lengths = [len(rows[i].token_ids) for i in call]
    slots = [rows[i].slot for i in call]
    grid = (max(slots) - min(slots) + 1) * max(lengths)
    if grid <= PAD_RATIO * sum(lengths):
        return [call]
    # decode rows: every token samples (one token, or one plus its drafts: speculative decoding)
    decodes = [i for i in call if rows[i].sample and rows[i].num_logits == len(rows[i].token_ids)]
    return ([decodes] if decodes else []) + [[i] for i in call if i not in decodes]


def build_step_arrays(rows: Sequence[EngineRow], slot_range: bool,
                      window: bool = False) -> StepArrays:
    """Arrays for one call over ``rows``.

    ``slot_range=True`` (in-place GQA form): batch entry b is slot lo + b for b in
    [0, max slot - lo], lo = 0, or with ``window`` the call's lowest slot (the engine binds
    that window of its slot buffers); slots without a row are idle (query_seqlens 0).
    ``False`` (canonical form): entry b is rows[b].
    """
    # whole-array operations, no numpy call per row (32 decode rows: 65 us, 183 with a loop)
    count = len(rows)
    slot_of = np.fromiter((r.slot for r in rows), np.int64, count)
    lengths = np.fromiter((len(r.token_ids) for r in rows), np.int64, count)
    starts = np.fromiter((r.start_pos for r in rows), np.int64, count)
    if slot_range:
        lo = int(slot_of.min()) if window else 0
        batch = int(slot_of.max()) + 1 - lo
        entry = slot_of - lo  # (count,) the batch entry of each row
        slots = np.arange(lo, lo + batch, dtype=np.int64)
    else:
        batch = count
        entry = np.arange(count, dtype=np.int64)
        slots = slot_of
    s_max, n = int(lengths.max()), int(lengths.sum())
    ends = np.cumsum(lengths)  # (count,) packed end of each row's chunk
    token_entry = np.repeat(entry, lengths)  # (n,) batch entry of each packed token
    within = np.arange(n) - np.repeat(ends - lengths, lengths)  # (n,) index in its chunk
    input_ids = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows), np.int64, n)
    pad_index = np.full((batch, s_max), n, dtype=np.int64)
    pad_index[token_entry, within] = np.arange(n)
    unpad_index = token_entry * s_max + within
    seqlens_k = np.zeros(batch, dtype=np.int32)
    seqlens_k[entry] = starts + lengths - 1
    query_seqlens = np.zeros(batch, dtype=np.int32)
    query_seqlens[entry] = lengths
    write_indices = np.zeros(batch, dtype=np.int64)
    write_indices[entry] = starts
    position_ids = np.zeros((batch, s_max), dtype=np.int64)
    position_ids[entry] = starts[:, None] + np.arange(s_max)
    # each row returns the logits of its last logits_count tokens (<= length; 0: none)
    sampled_rows = [i for i, r in enumerate(rows) if r.logits_count]
    counts = np.fromiter((rows[i].logits_count for i in sampled_rows), np.int64, len(sampled_rows))
    firsts = ends[sampled_rows] - counts
    logits_index = np.repeat(firsts, counts) + np.arange(int(counts.sum())) \
        - np.repeat(np.cumsum(counts) - counts, counts)
    return StepArrays(input_ids, pad_index, unpad_index, logits_index,
                      seqlens_k, query_seqlens, position_ids, write_indices, slots, sampled_rows)


def merge_call_logits(rows: Sequence[EngineRow], calls: Sequence[Sequence[int]],
                      call_logits: Sequence[np.ndarray], vocab: int) -> np.ndarray:
    """The logits of several calls (``call_logits[c]`` over rows ``calls[c]``, each sampled row's
    ``logits_count`` rows in the call's row order) in the order of ``rows``."""
    if len(calls) == 1:  # one call over all rows: already in row order
        return call_logits[0]
    starts = np.cumsum([0] + [r.logits_count for r in rows])
    out = np.empty((int(starts[-1]), vocab), np.float32)
    for call, logits in zip(calls, call_logits, strict=True):
        at = 0
        for i in call:
            n = rows[i].logits_count
            out[starts[i]:starts[i] + n] = logits[at:at + n]
            at += n
    return out


@dataclass
class PagedArrays:
    """Inputs of one step over a paged KV pool (the ``paged`` graph form, the torch engine):
    N packed tokens of B rows, the last ``padding`` of them single tokens in the scratch block."""

    input_ids: np.ndarray  # int64 (N,)
    positions: np.ndarray  # int64 (N,)
    slot_mapping: np.ndarray  # int64 (N,) block_id * block_size + offset of each token's K/V
    block_tables: np.ndarray  # int32 (B, W)
    seq_lens: np.ndarray  # int32 (B,) tokens of the row after the step
    query_start: np.ndarray  # int32 (B + 1,) cumulative tokens per row
    logits_index: np.ndarray  # int64 (R,) packed index of each row's logits tokens, padding last
    num_logits: int  # the first num_logits entries of logits_index are the rows' (the rest padding)


def build_paged_arrays(rows: Sequence[EngineRow], block_size: int, scratch_block: int,
                       padding: int = 0, table_width: int = 0) -> PagedArrays:
    """Pack ``rows`` plus ``padding`` rows (one token each, written to ``scratch_block`` and
    sampled; their logits are to be dropped) into a paged step; block tables are ``table_width``
    wide, or as wide as the widest row's (at least 1). A row's table must hold its positions."""
    count = len(rows)
    lengths = np.fromiter((len(r.token_ids) for r in rows), np.int64, count)
    starts_pos = np.fromiter((r.start_pos for r in rows), np.int64, count)
    ends = starts_pos + lengths
    widths = np.fromiter((len(r.block_table) for r in rows), np.int64, count)
    short = np.flatnonzero(widths * block_size < ends)
    if len(short):
        b = int(short[0])
        raise ValueError(f"row {b}: block table of {widths[b]} blocks cannot hold "
                         f"{ends[b]} positions")
    width = max(table_width, 1, int(widths.max()) if count else 0)
    tables = np.full((count + padding, width), scratch_block, dtype=np.int32)
    for b, r in enumerate(rows):
        tables[b, :len(r.block_table)] = r.block_table
    n = int(lengths.sum())
    query_start = np.zeros(count + padding + 1, dtype=np.int32)
    np.cumsum(np.concatenate([lengths, np.ones(padding, np.int64)]), out=query_start[1:])
    row_of = np.repeat(np.arange(count), lengths)  # (n,) the row of each packed token
    positions = np.empty(n + padding, dtype=np.int64)
    positions[:n] = np.arange(n) - np.repeat(query_start[:count], lengths) + starts_pos[row_of]
    positions[n:] = 0
    slot_mapping = np.empty(n + padding, dtype=np.int64)
    slot_mapping[:n] = tables[row_of, positions[:n] // block_size] * np.int64(block_size) \
        + positions[:n] % block_size
    slot_mapping[n:] = scratch_block * block_size
    input_ids = np.zeros(n + padding, dtype=np.int64)
    input_ids[:n] = np.fromiter(itertools.chain.from_iterable(r.token_ids for r in rows), np.int64, n)
    seq_lens = np.ones(count + padding, dtype=np.int32)
    seq_lens[:count] = ends
    # each row's last logits_count tokens (drafts + 1 when it samples, all with prompt_logits)
    counts = np.fromiter((r.logits_count for r in rows), np.int64, count)
    over = np.flatnonzero(counts > lengths)
    if len(over):
        b = int(over[0])
        raise ValueError(f"row {b}: {counts[b]} logits from {lengths[b]} tokens")
    firsts = query_start[1:count + 1] - counts
    index = np.repeat(firsts, counts) + np.arange(int(counts.sum())) \
        - np.repeat(np.cumsum(counts) - counts, counts)
    logits_index = np.concatenate([index, query_start[count:count + padding]]).astype(np.int64)
    return PagedArrays(input_ids, positions, slot_mapping, tables, seq_lens, query_start,
                       logits_index, len(index))
