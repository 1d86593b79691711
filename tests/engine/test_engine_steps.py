"""Mixed steps (prefill chunks + decodes in one call) give the same tokens as running alone."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_factories import PROMPTS, greedy, make_engine, make_named_checkpoint

from inferflow.models.checkpoint import load_checkpoint
from inferflow.runtimes.step_inputs import EngineRow, build_step_arrays, split_calls


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_named_checkpoint(tmp_path_factory.mktemp("steps"), "gqa8x2")


def test_step_arrays_pack_and_pad_rows() -> None:
    rows = [EngineRow(2, (7, 8, 9), 0, True), EngineRow(0, (5,), 10, True)]
    a = build_step_arrays(rows, slot_range=True)
    assert a.input_ids.tolist() == [7, 8, 9, 5]
    # batch entries are slots 0..2; slot 1 is idle (no valid tokens, cache untouched)
    assert a.query_seqlens.tolist() == [1, 0, 3]
    assert a.seqlens_k.tolist() == [10, 0, 2]
    assert a.pad_index.tolist() == [[3, 4, 4], [4, 4, 4], [0, 1, 2]]  # 4 == N marks padding
    assert a.unpad_index.tolist() == [6, 7, 8, 0]
    assert a.logits_index.tolist() == [2, 3]
    canon = build_step_arrays(rows, slot_range=False)
    assert canon.slots.tolist() == [2, 0]
    assert canon.position_ids.tolist() == [[0, 1, 2], [10, 11, 12]]
    assert canon.write_indices.tolist() == [0, 10]


def test_split_calls_keeps_padded_chunks_inside_slots() -> None:
    # capacity 16: a decode at position 15 cannot share a call padded to 4 tokens
    rows = [EngineRow(0, (1, 2, 3, 4), 0, True), EngineRow(1, (5,), 15, True), EngineRow(2, (6,), 3, True)]
    assert split_calls(rows, capacity=16) == [[0, 2], [1]]
    assert split_calls(rows, capacity=64) == [[0, 1, 2]]


@pytest.mark.parametrize("form", ["gqa", "canonical"])
def test_batch_of_different_lengths_equals_each_alone(ckpt: Path, form: str) -> None:
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    alone = [greedy(make_engine(ckpt, graph_form=form), p, 12)[0] for p in prompts]
    engine = make_engine(ckpt, graph_form=form)
    # slots 0..3; prompt 2 joins late so prefill chunks and decodes share steps
    outputs: dict[int, list[int]] = {i: [] for i in range(4)}
    pos = {i: 0 for i in range(4)}
    pending = {i: list(prompts[i]) for i in range(4)}
    for step in range(40):
        rows = []
        for i in range(4):
            if (i == 2 and step < 3) or len(outputs[i]) >= 12:
                continue
            todo = pending[i][:5]  # prefill in chunks of 5 tokens
            rows.append(EngineRow(i, tuple(todo), pos[i], len(todo) == len(pending[i])))
        if not rows:
            break
        logits = engine.forward(rows)
        k = 0
        for r in rows:
            pos[r.slot] += len(r.token_ids)
            pending[r.slot] = pending[r.slot][len(r.token_ids):]
            if r.sample:
                tok_id = int(np.argmax(logits[k]))
                k += 1
                outputs[r.slot].append(tok_id)
                pending[r.slot] = [tok_id]
    assert [outputs[i] for i in range(4)] == alone


def test_gqa_and_canonical_forms_agree(ckpt: Path) -> None:
    prompt = load_checkpoint(ckpt).tokenizer.encode(PROMPTS[0])
    _, gqa_logits = greedy(make_engine(ckpt, graph_form="gqa"), prompt, 8)
    _, ref_logits = greedy(make_engine(ckpt, graph_form="canonical"), prompt, 8)
    np.testing.assert_allclose(np.stack(gqa_logits), np.stack(ref_logits), atol=1e-4, rtol=0)


def test_rows_that_do_not_fit_are_refused(ckpt: Path) -> None:
    engine = make_engine(ckpt, max_model_len=32)
    with pytest.raises(ValueError, match="does not fit"):
        engine.forward([EngineRow(0, tuple(range(5, 10)), 30, True)])
