"""One step's rows -> the packed tensors of ``TorchLlama.forward`` (pure, testable without a model).

A row is one sequence's chunk: ``token_ids`` at positions ``[start_pos, start_pos + len)``, KV in
the blocks of ``block_table``. Every batch gets two *padding rows* (a single token each in the scratch
block, sampled and dropped) and block tables at least two wide, so no dimension is ever 0 or 1:
``torch.compile(dynamic=True)`` specialises sizes 0 and 1, and the padding keeps one graph for
every step. CUDA-graph buckets
pad further, to a fixed row count and block-table width (``pad_rows``).

With multi-LoRA (``LoraScales``) the batch also carries ``lora_mask`` (N, S*R): for each packed
token, its row's adapter scaling on the R columns of the row's slot (``EngineRow.lora_slot``),
0 elsewhere; base-model rows (slot -1) and padding rows are all zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    lora_mask: torch.Tensor | None = None  # engine dtype (N, S*R); None: engine without LoRA

    def to(self, device: torch.device) -> StepBatch:
        move = {k: v.to(device, non_blocking=True) for k, v in vars(self).items()
                if isinstance(v, torch.Tensor)}
        return StepBatch(**move, decode_only=self.decode_only, num_sampled=self.num_sampled)

    def forward_args(self) -> tuple[object, ...]:
        """``TorchLlama.forward``'s positional arguments (the mask last, where there is one;
        the LoRA stacks are the model's, not the batch's)."""
        args = (self.input_ids, self.positions, self.slot_mapping, self.block_tables,
                self.seq_lens, self.query_start, self.sample_index, self.decode_only)
        return args if self.lora_mask is None else (*args, self.lora_mask)


@dataclass(frozen=True)
class LoraScales:
    """What a step's LoRA mask is made of: ``scaling`` (S,) float32, each slot's adapter
    scaling (0 for an empty slot; the runner updates it in place), the slot rank R, and the
    engine's dtype."""

    scaling: np.ndarray
    rank: int
    dtype: torch.dtype

    def mask(self, rows: Sequence[EngineRow], num_tokens: int) -> torch.Tensor:
        """(num_tokens, S*R): the rows' tokens first (packed order), then padding tokens (0)."""
        slots = len(self.scaling)
        row_slot = np.fromiter((r.lora_slot for r in rows), np.int64, len(rows))
        bad = np.flatnonzero((row_slot < -1) | (row_slot >= slots))
        if len(bad):
            raise ValueError(f"row {int(bad[0])}: lora_slot {int(row_slot[bad[0]])} outside "
                             f"[-1, {slots})")
        lengths = np.fromiter((len(r.token_ids) for r in rows), np.int64, len(rows))
        token_slot = np.full(num_tokens, -1, np.int64)
        token_slot[:int(lengths.sum())] = np.repeat(row_slot, lengths)
        per_slot = np.where(token_slot[:, None] == np.arange(slots), self.scaling[None, :],
                            np.float32(0))  # (N, S)
        mask = np.repeat(per_slot.astype(np.float32), self.rank, axis=1)  # (N, S*R)
        return torch.from_numpy(mask).to(self.dtype)


def build_step_batch(rows: Sequence[EngineRow], block_size: int, scratch_block: int,
                     pad_rows: int = 0, table_width: int = 0,
                     lora: LoraScales | None = None) -> StepBatch:
    """Pack ``rows`` plus padding rows (at least two; ``pad_rows`` rows in all when that is more)
    whose tokens write to ``scratch_block``; ``table_width`` pads block tables (0 = the widest row's,
    at least two); ``lora``: the LoRA mask too (an engine with LoRA)."""
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
        lora_mask=None if lora is None else lora.mask(rows, len(a.input_ids)),
    )
