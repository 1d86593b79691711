"""Mixed steps (prefill chunks + decodes in one call) give the same tokens as running alone."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
from engine_factories import PROMPTS, greedy, make_engine, make_named_checkpoint

from inferflow.models.checkpoint import load_checkpoint
from inferflow.runtimes.step_inputs import EngineRow, build_step_arrays, split_calls, split_padding


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


def _reference_arrays(rows: list[EngineRow], slot_range: bool, window: bool) -> dict[str, list]:
    """build_step_arrays by its definition, one row at a time (what the vectorised code computes)."""
    lo = min(r.slot for r in rows) if (slot_range and window) else 0
    batch = max(r.slot for r in rows) + 1 - lo if slot_range else len(rows)
    entry = {r.slot: (r.slot - lo if slot_range else b) for b, r in enumerate(rows)}
    s_max, n = max(len(r.token_ids) for r in rows), sum(len(r.token_ids) for r in rows)
    out: dict[str, list] = {"pad_index": [[n] * s_max for _ in range(batch)], "unpad_index": [],
                            "input_ids": [], "seqlens_k": [0] * batch, "query_seqlens": [0] * batch,
                            "write_indices": [0] * batch, "position_ids": [[0] * s_max for _ in range(batch)],
                            "logits_index": [], "sampled_rows": []}
    offset = 0
    for i, r in enumerate(rows):
        b, length = entry[r.slot], len(r.token_ids)
        out["input_ids"] += list(r.token_ids)
        for k in range(length):
            out["pad_index"][b][k] = offset + k
            out["unpad_index"].append(b * s_max + k)
        out["seqlens_k"][b], out["query_seqlens"][b] = r.start_pos + length - 1, length
        out["write_indices"][b] = r.start_pos
        out["position_ids"][b] = [r.start_pos + k for k in range(s_max)]
        if r.sample:
            out["logits_index"] += list(range(offset + length - r.num_logits, offset + length))
            out["sampled_rows"].append(i)
        offset += length
    out["slots"] = list(range(lo, lo + batch)) if slot_range else [r.slot for r in rows]
    return out


@pytest.mark.parametrize("seed", range(20))
def test_step_arrays_match_their_row_by_row_definition(seed: int) -> None:
    rng = random.Random(seed)
    rows = []
    for slot in rng.sample(range(40), rng.randint(1, 12)):
        length = rng.choice([1, 1, rng.randint(1, 20)])  # decodes, and prefill chunks
        sample = rng.random() < 0.7
        rows.append(EngineRow(slot, tuple(rng.randrange(1000) for _ in range(length)),
                              rng.randrange(100), sample, num_logits=rng.randint(1, length) if sample else 1))
    for slot_range, window in ((True, False), (True, True), (False, False)):
        arrays = build_step_arrays(rows, slot_range, window)
        for name, expected in _reference_arrays(rows, slot_range, window).items():
            got = getattr(arrays, name)
            assert (got if name == "sampled_rows" else got.tolist()) == expected, name
        assert arrays.seqlens_k.dtype == arrays.query_seqlens.dtype == np.int32
        assert all(getattr(arrays, name).dtype == np.int64 for name in
                   ("input_ids", "pad_index", "unpad_index", "logits_index", "position_ids", "write_indices", "slots"))


def test_split_calls_keeps_padded_chunks_inside_slots() -> None:
    # capacity 16: a decode at position 15 cannot share a call padded to 4 tokens
    rows = [EngineRow(0, (1, 2, 3, 4), 0, True), EngineRow(1, (5,), 15, True), EngineRow(2, (6,), 3, True)]
    assert split_calls(rows, capacity=16) == [[0, 2], [1]]
    assert split_calls(rows, capacity=64) == [[0, 1, 2]]


def test_window_arrays_start_at_the_lowest_slot() -> None:
    rows = [EngineRow(6, (7, 8), 0, True), EngineRow(4, (5,), 10, True)]
    a = build_step_arrays(rows, slot_range=True, window=True)
    assert a.slots.tolist() == [4, 5, 6]  # slots 0..3 are not in the call at all
    assert a.query_seqlens.tolist() == [1, 0, 2]
    assert a.pad_index.tolist() == [[2, 3], [3, 3], [0, 1]]


def test_a_call_mostly_padding_is_split() -> None:
    decodes = [EngineRow(s, (1,), 20, True) for s in range(6)]
    prefill = EngineRow(7, tuple(range(40)), 0, True)
    rows = [*decodes, prefill]
    # an 8 x 40 grid for 46 tokens: the decodes run together, the prefill chunk alone
    assert split_padding(rows, list(range(7))) == [[0, 1, 2, 3, 4, 5], [6]]
    # decodes alone, or a short chunk beside them: no split
    assert split_padding(rows, list(range(6))) == [list(range(6))]
    short = [*decodes, EngineRow(6, (1, 2, 3), 0, True)]
    assert split_padding(short, list(range(7))) == [list(range(7))]


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


def test_a_split_step_equals_each_alone(ckpt: Path) -> None:
    """A whole prompt at slot 7 beside decodes at slots 0-1 runs as separate calls (the padded
    grid would be mostly padding); the tokens are those of each prompt alone."""
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    alone = [greedy(make_engine(ckpt), p, 8)[0] for p in prompts]
    engine = make_engine(ckpt, max_slots=8)
    slot_of = {0: 0, 1: 1, 2: 7}
    outputs: dict[int, list[int]] = {i: [] for i in range(3)}
    pos = {i: 0 for i in range(3)}
    pending = {i: list(prompts[i]) for i in range(3)}
    for step in range(30):
        rows = [EngineRow(slot_of[i], tuple(pending[i]), pos[i], True) for i in range(3)
                if (i != 2 or step >= 3) and len(outputs[i]) < 8]
        if not rows:
            break
        if step == 3:
            assert len(split_padding(rows, list(range(len(rows))))) == 2
        logits = engine.forward(rows)
        for k, r in enumerate(rows):
            i = next(i for i, s in slot_of.items() if s == r.slot)
            pos[i] += len(r.token_ids)
            outputs[i].append(int(np.argmax(logits[k])))
            pending[i] = [outputs[i][-1]]
    assert [outputs[i] for i in range(3)] == alone


def test_gqa_and_canonical_forms_agree(ckpt: Path) -> None:
    prompt = load_checkpoint(ckpt).tokenizer.encode(PROMPTS[0])
    _, gqa_logits = greedy(make_engine(ckpt, graph_form="gqa"), prompt, 8)
    _, ref_logits = greedy(make_engine(ckpt, graph_form="canonical"), prompt, 8)
    np.testing.assert_allclose(np.stack(gqa_logits), np.stack(ref_logits), atol=1e-4, rtol=0)


def test_rows_that_do_not_fit_are_refused(ckpt: Path) -> None:
    engine = make_engine(ckpt, max_model_len=32)
    with pytest.raises(ValueError, match="does not fit"):
        engine.forward([EngineRow(0, tuple(range(5, 10)), 30, True)])


def test_block_copies_move_exactly_their_positions(ckpt: Path) -> None:
    """save_blocks/load_blocks (one indexing operation per layer and kind) copy each block's
    positions and nothing else, also in a slot whose capacity is not a multiple of the block."""
    from inferflow.scheduling.plan import KVBlockCopy

    engine = make_engine(ckpt, max_model_len=250, block_size=16, max_slots=3, num_blocks=8)
    rng = np.random.default_rng(0)
    for layer in (*engine.kv, *engine.pool):
        for buf in layer:
            buf[...] = rng.random(buf.shape, dtype=np.float32)
    kv = [tuple(b.copy() for b in layer) for layer in engine.kv]
    pool = [tuple(b.copy() for b in layer) for layer in engine.pool]
    saves = [KVBlockCopy(0, 0, 5), KVBlockCopy(2, 14, 1), KVBlockCopy(1, 3, 7)]  # 14: 224..239
    engine.save_blocks(saves)
    for c in saves:
        for layer, ref in zip(kv, pool, strict=True):
            for kind in (0, 1):
                ref[kind][c.block_id] = layer[kind][c.slot, :, c.block_index * 16:][:, :16]
    loads = [KVBlockCopy(1, 14, 5), KVBlockCopy(0, 2, 1)]
    engine.load_blocks(loads)
    for c in loads:
        for layer, ref in zip(kv, pool, strict=True):
            for kind in (0, 1):
                layer[kind][c.slot, :, c.block_index * 16:c.block_index * 16 + 16] = ref[kind][c.block_id]
    for got, want in ((engine.pool, pool), (engine.kv, kv)):
        for g, w in zip(got, want, strict=True):
            assert np.array_equal(g[0], w[0]) and np.array_equal(g[1], w[1])
