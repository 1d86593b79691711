"""One step's rows -> the packed tensors of ``TorchLlama.forward`` (pure, testable without a model).

A row is one sequence's chunk: ``token_ids`` at positions ``[start_pos, start_pos + len)``, KV in
the blocks of ``block_table``. Every batch gets two *padding rows* (a single token each in the scratch
block, sampled and dropped) and block tables at least two wide, so no dimension is ever 0 or 1:
``torch.compile(dynamic=True)`` specialises sizes 0 and 1, and the padding keeps one graph for
every step. CUDA-graph buckets
pad further, to a fixed row count and block-table width (``pad_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from inferflow.runtimes.step_inputs import EngineRow


@dataclass
class StepBatch:
    input_ids: torch.Tensor  # int64 (N,)
    positions: torch.Tensor  # int64 (N,)
    slot_mapping: torch.Tensor  # int64 (N,) block_id * block_size + offset
    block_tables: torch.Tensor  # int32 (B, W)
    seq_lens: torch.Tensor  # int32 (B,)
    query_start: torch.Tensor  # int32 (B + 1,)
    sample_index: torch.Tensor  # int64 (R,) packed index of each row's logits tokens
    decode_only: bool
    num_sampled: int  # the first num_sampled logits rows are real (the rest is padding)

    def to(self, device: torch.device) -> StepBatch:
        move = {k: v.to(device, non_blocking=True) for k, v in vars(self).items()
                if isinstance(v, torch.Tensor)}
        return StepBatch(**move, decode_only=self.decode_only, num_sampled=self.num_sampled)

    def forward_args(self) -> tuple[object, ...]:
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                self.seq_lens, self.query_start, self.sample_index, self.decode_only)


def build_step_batch(rows: Sequence[EngineRow], block_size: int, scratch_block: int,
                     pad_rows: int = 0, table_width: int = 0) -> StepBatch:
    """Pack ``rows`` plus padding rows (at least two; ``pad_rows`` rows in all when that is more)
    whose tokens write to ``scratch_block``; ``table_width`` pads block tables (0 = the widest row's)."""
    padding = max(2, pad_rows - len(rows))
    lengths = [len(r.token_ids) for r in rows] + [1] * padding
    width = max([table_width, 2, *(len(r.block_table) for r in rows)])
    tables = np.full((len(lengths), width), scratch_block, dtype=np.int32)
    input_ids = np.zeros(sum(lengths), dtype=np.int64)
    positions = np.zeros_like(input_ids)
    slot_mapping = np.full_like(input_ids, scratch_block * block_size)
    seq_lens = np.ones(len(lengths), dtype=np.int32)
    starts = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=starts[1:])
    sampled: list[int] = []
    for b, row in enumerate(rows):
        start, length = int(starts[b]), lengths[b]
        table = np.asarray(row.block_table, dtype=np.int64)
        end_pos = row.start_pos + length
        if len(table) * block_size < end_pos:
            raise ValueError(f"row {b}: block table of {len(table)} blocks cannot hold "
                             f"{end_pos} positions")
        pos = np.arange(row.start_pos, end_pos)
        input_ids[start:start + length] = row.token_ids
        positions[start:start + length] = pos
        slot_mapping[start:start + length] = table[pos // block_size] * block_size + pos % block_size
        tables[b, :len(table)] = table
        seq_lens[b] = end_pos
        # the row's last logits_count tokens: drafts + 1 when it samples, all with prompt_logits
        count = row.logits_count
        if count:
            if count > length:
                raise ValueError(f"row {b}: {count} logits from {length} tokens")
            sampled.extend(range(start + length - count, start + length))
    num_sampled = len(sampled)
    sampled += [int(starts[b]) for b in range(len(rows), len(lengths))]  # padding rows' tokens
    return StepBatch(
        input_ids=torch.from_numpy(input_ids),
        positions=torch.from_numpy(positions),
        slot_mapping=torch.from_numpy(slot_mapping),
        block_tables=torch.from_numpy(tables),
        seq_lens=torch.from_numpy(seq_lens),
        query_start=torch.from_numpy(starts),
        sample_index=torch.tensor(sampled, dtype=torch.int64),
        decode_only=all(n == 1 for n in lengths),
        num_sampled=num_sampled,
    )
