"""The torch executor's parts without a model: step packing, CUDA-graph buckets, the paged
attention op against a dense reference, the Triton decode kernel under ``TRITON_INTERPRET=1``
(CPU), and the same kernel on a GPU when there is one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

from inferflow.runtimes.step_inputs import EngineRow  # noqa: E402
from inferflow.runtimes.torch_engine.attention import (  # noqa: E402
    KV_CACHES,
    paged_attention,
    reference_attention,
)
from inferflow.runtimes.torch_engine.runner import graph_buckets  # noqa: E402
from inferflow.runtimes.torch_engine.step_batch import build_step_batch  # noqa: E402


def test_step_batch_maps_tokens_to_their_blocks_and_pads() -> None:
    rows = [EngineRow(0, (11, 12, 13), 6, True, (4, 9)),  # positions 6-8: block 4, 4, then 9
            EngineRow(1, (21,), 17, True, (3, 1, 8))]  # position 17: block 8, offset 1
    batch = build_step_batch(rows, block_size=8, scratch_block=20)
    assert batch.input_ids.tolist()[:4] == [11, 12, 13, 21]
    assert batch.positions.tolist()[:4] == [6, 7, 8, 17]
    assert batch.slot_mapping.tolist()[:4] == [4 * 8 + 6, 4 * 8 + 7, 9 * 8 + 0, 8 * 8 + 1]
    assert batch.seq_lens.tolist() == [9, 18, 1, 1]  # two padding rows
    assert batch.query_start.tolist() == [0, 3, 4, 5, 6]
    assert batch.block_tables.tolist()[0] == [4, 9, 20] and batch.block_tables.shape == (4, 3)
    assert batch.sample_index.tolist() == [2, 3, 4, 5] and batch.num_sampled == 2
    assert batch.slot_mapping.tolist()[4:] == [160, 160]  # padding writes the scratch block
    assert not batch.decode_only


def test_step_batch_sizes_never_fall_to_one() -> None:
    """torch.compile(dynamic=True) specialises sizes 0 and 1: a lone decode still packs >= 2."""
    batch = build_step_batch([EngineRow(0, (5,), 0, True, (0,))], block_size=16, scratch_block=3)
    assert batch.input_ids.shape[0] >= 2 and batch.block_tables.shape == (3, 2)
    assert batch.sample_index.shape[0] >= 2 and batch.decode_only
    chunk = build_step_batch([EngineRow(0, (5, 6), 0, False, (0,))], block_size=16, scratch_block=3)
    assert chunk.num_sampled == 0 and chunk.sample_index.shape[0] == 2


def test_a_block_table_too_short_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 17 positions"):
        build_step_batch([EngineRow(0, (1,), 16, True, (0,))], block_size=16, scratch_block=2)


def test_graph_buckets_cover_every_batch_size() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 64]


def dense_attention(q, keys, values, scale, window=0, softcap=0.0):  # type: ignore[no-untyped-def]
    """Causal attention of the last len(q) positions over (L, Hkv, D) keys (no paging), written
    out independently of the op: explicit scores, GQA by repeating heads, the window as
    ``p - W < j <= p``, soft-capping as ``cap * tanh(s / cap)`` before the mask."""
    q_len, ctx = q.shape[0], keys.shape[0]
    group = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # (Hq, L, D)
    v = values.repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (q.transpose(0, 1) @ k.transpose(1, 2)) * scale  # (Hq, q_len, L)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    p = torch.arange(ctx - q_len, ctx)[:, None]
    j = torch.arange(ctx)[None, :]
    seen = (j <= p) & ((p - j < window) if window else True)
    scores = scores.masked_fill(~seen, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 2.0), (3, 1.5)])
def test_paged_attention_equals_dense_attention_on_scattered_blocks(window: int, softcap: float) -> None:
    """A prefill chunk and a decode, through windows that cut blocks in the middle (block size
    4; windows 3 and 5) and with soft-capped scores."""
    torch.manual_seed(0)
    bs, hq, hkv, d = 4, 6, 2, 8
    k_cache, v_cache = torch.zeros(12, bs, hkv, d), torch.zeros(12, bs, hkv, d)
    # row 0: 3 cached + 4 new tokens in blocks (7, 2); row 1: a decode at position 9 in (5, 0, 3)
    lens, news, tables = [7, 10], [4, 1], [[7, 2, 11], [5, 0, 3]]
    full_k = [torch.randn(n, hkv, d) for n in lens]
    full_v = [torch.randn(n, hkv, d) for n in lens]
    for r in range(2):  # the cached part is already in the blocks
        for p in range(lens[r] - news[r]):
            k_cache[tables[r][p // bs], p % bs] = full_k[r][p]
            v_cache[tables[r][p // bs], p % bs] = full_v[r][p]
    slots = [tables[r][p // bs] * bs + p % bs for r in range(2) for p in range(lens[r] - news[r], lens[r])]
    q = torch.randn(sum(news), hq, d) * 3  # large scores: the cap matters
    k = torch.cat([full_k[r][-news[r]:] for r in range(2)])
    v = torch.cat([full_v[r][-news[r]:] for r in range(2)])
    cache_id = KV_CACHES.register([(k_cache, v_cache)])
    out = paged_attention(q, k, v, torch.tensor(slots), torch.tensor(tables, dtype=torch.int32),
                          torch.tensor(lens, dtype=torch.int32),
                          torch.tensor([0, 4, 5], dtype=torch.int32), cache_id, 0, 0.35, False,
                          window, softcap)
    KV_CACHES.release(cache_id)
    # the new tokens' K/V were written into their blocks
    assert torch.equal(k_cache[2, 2], full_k[0][6]) and torch.equal(v_cache[3, 1], full_v[1][9])
    torch.testing.assert_close(out[:4], dense_attention(q[:4], full_k[0], full_v[0], 0.35, window, softcap))
    torch.testing.assert_close(out[4:], dense_attention(q[4:], full_k[1], full_v[1], 0.35, window, softcap))


def test_a_window_reads_no_block_before_it() -> None:
    """Blocks wholly before every query's window may hold anything (the KV manager may have
    freed and reused them): poisoning them with NaN changes nothing, in prefill and decode."""
    torch.manual_seed(1)
    bs, hkv, d, window = 4, 2, 8, 5
    k_cache, v_cache = torch.randn(8, bs, hkv, d), torch.randn(8, bs, hkv, d)
    # rows of 14 positions in blocks (0, 1, 2, 3): a 3-token chunk (positions 11-13, first
    # visible key 7 -> block 1 on) and a decode at 13 (first visible key 9 -> block 2 on)
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([14, 14], dtype=torch.int32)
    q = torch.randn(4, 4, d)
    starts = torch.tensor([0, 3, 4], dtype=torch.int32)
    before = reference_attention(q, k_cache, v_cache, tables, lens, starts, 0.3, window)
    for block in (0, 4, 5):
        k_cache[block], v_cache[block] = float("nan"), float("nan")
    after = reference_attention(q, k_cache, v_cache, tables, lens, starts, 0.3, window)
    torch.testing.assert_close(after, before)


KERNEL_CHECK = textwrap.dedent("""
    import torch
    from inferflow.runtimes.torch_engine.attention import reference_attention
    from inferflow.runtimes.torch_engine.triton_paged import paged_decode_attention
    torch.manual_seed(0)
    device = "{device}"
    for (blocks, bs, hkv, d, hq) in [(20, 16, 2, 24, 8), (9, 8, 4, 64, 4), (30, 16, 1, 32, 8)]:
        k = torch.randn(blocks, bs, hkv, d, device=device)
        v = torch.randn(blocks, bs, hkv, d, device=device)
        lens = torch.tensor([1, 5, 33, bs, 2 * bs + 1], dtype=torch.int32, device=device)
        tables = torch.randint(0, blocks, (5, 5), dtype=torch.int32, device=device)
        q = torch.randn(5, hq, d, device=device) * 2
        starts = torch.arange(6, dtype=torch.int32, device=device)
        # no window; windows inside a block, across blocks, wider than some rows; soft-capping
        for window, softcap in [(0, 0.0), (3, 0.0), (bs + 5, 0.0), (0, 1.5), (7, 2.0)]:
            ref = reference_attention(q, k, v, tables, lens, starts, d ** -0.5, window, softcap)
            out = paged_decode_attention(q, k, v, tables, lens, d ** -0.5, window, softcap)
            err = (ref - out).abs().max().item()
            assert err < 1e-4, (blocks, bs, hkv, d, hq, window, softcap, err)
    print("ok")
""")


@pytest.mark.slow  # the Triton interpreter in a subprocess
def test_triton_paged_decode_kernel_matches_the_reference_in_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}  # read when the kernel is defined
    result = subprocess.run([sys.executable, "-c", KERNEL_CHECK.format(device="cpu")], env=env,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_paged_decode_kernel_on_the_gpu() -> None:
    result = subprocess.run([sys.executable, "-c", KERNEL_CHECK.format(device="cuda")],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr[-3000:]

