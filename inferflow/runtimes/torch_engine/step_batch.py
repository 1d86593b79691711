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

import torch

from inferflow.runtimes.step_inputs import EngineRow, build_paged_arrays


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
    whose tokens write to ``scratch_block``; ``table_width`` pads block tables (0 = the widest row's,
    at least two)."""
    a = build_paged_arrays(rows, block_size, scratch_block, max(2, pad_rows - len(rows)),
                           max(2, table_width))
    return StepBatch(
        input_ids=torch.from_numpy(a.input_ids),
        positions=torch.from_numpy(a.positions),
        slot_mapping=torch.from_numpy(a.slot_mapping),
        block_tables=torch.from_numpy(a.block_tables),
        seq_lens=torch.from_numpy(a.seq_lens),
        query_start=torch.from_numpy(a.query_start),
        sample_index=torch.from_numpy(a.logits_index),
        decode_only=all(len(r.token_ids) == 1 for r in rows),
        num_sampled=a.num_logits,
    )
