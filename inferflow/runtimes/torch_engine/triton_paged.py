"""Triton paged decode attention (flash-decoding): one query token per row, KV read through
block tables, the row's KV split across programs, GQA groups sharing each KV load.

Phase 1, one program per (row, KV head, split): the GROUP query heads that share the KV head
(padded to ``BLOCK_G`` >= 16 rows, so ``tl.dot`` runs on tensor cores) walk the split's share of
the row's visible positions, ``BLOCK_N`` at a time. Each position's block comes from the block
table (``block_tables[row, pos // S]``), so a tile may span blocks. The program keeps an online
softmax (running max, sum, accumulator) and writes its partial result, normalized, with its
log-sum-exp. Phase 2, one program per (row, query head), combines the splits' partials by their
log-sum-exp. A split with no visible position writes lse = -inf and weighs nothing.

The number of splits is decided on the host from shapes only (rows, KV heads, table width and
the GPU's multiprocessor count), never from ``seq_lens``: no host synchronisation, and a
CUDA-graph bucket (fixed shapes) always gets the same launch. Per row, the split bounds are
computed on the device from ``seq_lens``.

Sliding windows and soft-capping as in ``attention.py``: with ``window`` W > 0 the walk starts at
position ``seq_len - W`` (the first key the query at ``seq_len - 1`` sees), so a windowed decode
reads at most W positions whatever the sequence length; with ``softcap`` > 0 the scaled scores go
through ``softcap * tanh(s / softcap)`` (tanh as ``2 * sigmoid(2x) - 1``, float32) first.

Shapes as in ``attention.py``: q (B, Hq, D), caches (P, S, Hkv, D), block_tables (B, W) int32,
seq_lens (B,) int32. Tested on CPU under ``TRITON_INTERPRET=1`` against
``attention.reference_attention`` (scattered blocks, odd lengths, GQA groups 1/4/8, several splits).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

NO_WINDOW = 2**30  # window 0 (none) as one wider than any context: lo = max(seq_len - W, 0) = 0
MAX_SPLITS = 32
MIN_SPLIT_POSITIONS = 128  # a split reads at least this many positions (else the reduce dominates)


@triton.jit
def gather_kv(
    cache_ptr,
    tables_row_ptr,
    pos,
    kv_head,
    offs_d,
    mask,
    d_mask,
    stride_b,
    stride_s,
    stride_h,
    BLOCK_SIZE: tl.constexpr,
):
    """(len(pos), BLOCK_D) rows of one KV head at positions ``pos`` of a row, each through its
    block, ``block_tables[row, pos // S]`` (masked positions and padded dims read 0)."""
    block_id = tl.load(tables_row_ptr + pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    ptrs = (
        cache_ptr
        + block_id[:, None] * stride_b
        + (pos % BLOCK_SIZE)[:, None] * stride_s
        + kv_head * stride_h
        + offs_d[None, :]
    )
    return tl.load(ptrs, mask=mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale,
    window,
    softcap,
    stride_qn,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pn,
    stride_ph,
    stride_ps,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr + row * stride_qn + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    seq_len = tl.load(seq_lens_ptr + row)
    lo = tl.maximum(seq_len - window, 0)  # the first visible position (the query: seq_len - 1)
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    tables_row = block_tables_ptr + row * stride_bt
    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for first in range(start, end, BLOCK_N):
        pos = first + offs_n
        valid = pos < end
        k = gather_kv(
            k_cache_ptr,
            tables_row,
            pos,
            kv_head,
            offs_d,
            valid,
            d_mask,
            stride_kb,
            stride_ks,
            stride_kh,
            BLOCK_SIZE,
        )
        scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(valid[None, :], scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = gather_kv(
            v_cache_ptr,
            tables_row,
            pos,
            kv_head,
            offs_d,
            valid,
            d_mask,
            stride_vb,
            stride_vs,
            stride_vh,
            BLOCK_SIZE,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    empty = l_i == 0.0  # no visible position in this split
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, -float("inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    base = row * stride_pn + heads * stride_ph + split * stride_ps
    tl.store(
        part_out_ptr + base[:, None] + offs_d[None, :], out, mask=g_mask[:, None] & d_mask[None, :]
    )
    tl.store(part_lse_ptr + (row * NUM_HEADS + heads) * NUM_SPLITS + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pn,
    stride_ph,
    stride_ps,
    stride_on,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_SPLITS)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM
    lse = tl.load(
        part_lse_ptr + (row * NUM_HEADS + head) * NUM_SPLITS + offs_s,
        mask=s_mask,
        other=-float("inf"),
    )
    m = tl.max(lse, axis=0)
    w = tl.where(lse == -float("inf"), 0.0, tl.exp(lse - m))
    parts = tl.load(
        part_out_ptr
        + row * stride_pn
        + head * stride_ph
        + offs_s[:, None] * stride_ps
        + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    total = tl.sum(w, axis=0)
    out = tl.sum(parts * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + row * stride_on + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return (
        int(torch.cuda.get_device_properties(device).multi_processor_count)
        if device.type == "cuda"
        else 8
    )


def decode_splits(rows: int, num_kv_heads: int, max_positions: int, device: torch.device) -> int:
    """How many programs share one row's KV (shapes only: CUDA-graph safe): enough programs to
    fill the GPU twice over, no split under ``MIN_SPLIT_POSITIONS`` positions, at most
    ``MAX_SPLITS``."""
    sms = _multiprocessors(device)
    want = triton.cdiv(2 * sms, max(1, rows * num_kv_heads))
    return max(1, min(MAX_SPLITS, want, triton.cdiv(max_positions, MIN_SPLIT_POSITIONS)))


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision: exact float32 products for float32 (no TF32 rounding), the
    default for 16-bit inputs (where it does not apply)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    num_splits: int = 0,
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D); every row decodes one token against ``seq_lens[b]`` positions
    of KV (already written) in the blocks of ``block_tables[b]`` (the last ``window`` of them
    where ``window`` > 0; scores soft-capped where ``softcap`` > 0). ``num_splits`` 0: decided
    from the shapes (``decode_splits``)."""
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the head dim must be contiguous")
    group = num_heads // num_kv_heads
    tables = block_tables.contiguous()
    max_positions = tables.shape[1] * block_size
    if window > 0:
        max_positions = min(max_positions, window)
    splits = num_splits or decode_splits(rows, num_kv_heads, max_positions, q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_out = torch.empty(rows, num_heads, splits, head_dim, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(rows, num_heads, splits, device=q.device, dtype=torch.float32)
    _decode_split_kernel[(rows, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        part_out,
        part_lse,
        scale,
        window if window > 0 else NO_WINDOW,
        softcap,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        NUM_HEADS=num_heads,
        GROUP=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=32 if block_d >= 256 else 64,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        SOFTCAP=softcap > 0.0,
        DOT_PRECISION=dot_precision(k_cache.dtype),
    )
    out = torch.empty_like(q)
    _decode_reduce_kernel[(rows, num_heads)](
        part_out,
        part_lse,
        out,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        out.stride(0),
        out.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=splits,
        BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)),
    )
    return out
