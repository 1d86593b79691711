"""Triton varlen prefill/extend attention over block tables (the steps with prefill chunks).

Every row's queries are the last ``q_len`` positions of its ``seq_len`` (a prefill chunk after a
cached prefix, or one decode token in a mixed step); their K/V are already in the blocks (the op
writes before it attends), so one walk over the block table covers the cached prefix and the
causal part of the chunk alike: key j is seen by the query at position p iff j <= p (and
p - W < j with a window W), as SGLang's ``extend_attention`` computes in two parts.

One program per (row, query tile, KV head): ``BLOCK_M`` consecutive query tokens of the row times
the ``GROUP`` query heads that share the KV head, flattened into ``BLOCK_M * BLOCK_G`` rows of one
tile, so each K/V load serves the whole group. It walks the positions from the first one its
first token sees (0, or ``p - W + 1``) to its last token's, ``BLOCK_N`` at a time, each
position's block from the table (``block_tables[row, pos // S]``), with an online softmax
(running max, sum, accumulator; ``tl.dot`` on both products).

No host synchronisation: the grid is sized from shapes alone. A row holds at most
``N - (B - 1)`` query tokens when every row holds at least one (the step batch's rows and
padding rows do), so ``cdiv(N - B + 1, BLOCK_M)`` tiles per row cover the longest; a tile past its
row's end returns at once.

Shapes as in ``attention.py``: q (N, Hq, D), caches (P, S, Hkv, D), block_tables (B, W) int32,
seq_lens (B,) int32, query_start (B + 1,) int32. Tested on CPU under ``TRITON_INTERPRET=1``
against ``attention.reference_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from inferflow.runtimes.torch_engine.triton_paged import NO_WINDOW, dot_precision, gather_kv


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
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
    stride_on,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    # tile rows: token t = r // BLOCK_G of the tile, head g = r % BLOCK_G of the group
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    offs_t = tile * BLOCK_M + offs_r // BLOCK_G
    offs_g = offs_r % BLOCK_G
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    r_mask = (offs_t < q_len) & (offs_g < GROUP)
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(
        q_ptr
        + (q_start + offs_t)[:, None] * stride_qn
        + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    q_pos = seq_len - q_len + offs_t  # each tile row's position
    first_pos = seq_len - q_len + tile * BLOCK_M
    last_pos = tl.minimum(first_pos + BLOCK_M, seq_len)  # one past the tile's last position
    lo = tl.maximum(first_pos - window + 1, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    tables_row = block_tables_ptr + row * stride_bt
    m_i = tl.full([BLOCK_M * BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, last_pos, BLOCK_N):
        pos = start + offs_n
        in_row = pos < last_pos
        k = gather_kv(
            k_cache_ptr,
            tables_row,
            pos,
            kv_head,
            offs_d,
            in_row,
            d_mask,
            stride_kb,
            stride_ks,
            stride_kh,
            BLOCK_SIZE,
        )
        scores = tl.dot(q.to(k.dtype), tl.trans(k), input_precision=DOT_PRECISION) * scale
        if SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        diff = q_pos[:, None] - pos[None, :]  # p - j
        seen = in_row[None, :] & (diff >= 0) & (diff < window)
        scores = tl.where(seen, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # rows that saw nothing yet
        p = tl.exp(scores - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = gather_kv(
            v_cache_ptr,
            tables_row,
            pos,
            kv_head,
            offs_d,
            in_row,
            d_mask,
            stride_vb,
            stride_vs,
            stride_vh,
            BLOCK_SIZE,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr
        + (q_start + offs_t)[:, None] * stride_on
        + heads[:, None] * stride_oh
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def paged_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    block_m: int = 0,
) -> torch.Tensor:
    """Attention of every row's query tokens (q (N, Hq, D), row b's at
    ``query_start[b]:query_start[b + 1]``, the last of its ``seq_lens[b]`` positions) over its
    cached KV (already written); (N, Hq, D). Every row must hold at least one query token.
    ``block_m``: query tokens per tile (0: 64 rows of tokens times heads)."""
    tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_extend_attention: the head dim must be contiguous")
    rows = block_tables.shape[0]
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    block_m = block_m or max(1, 64 // block_g)
    block_d = max(16, triton.next_power_of_2(head_dim))
    tables = block_tables.contiguous()
    out = torch.empty_like(q)
    longest = max(1, tokens - rows + 1)  # a bound on any row's query tokens (docstring)
    _extend_kernel[(rows, triton.cdiv(longest, block_m), num_kv_heads)](
        q,
        k_cache,
        v_cache,
        tables,
        seq_lens,
        query_start,
        out,
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
        out.stride(0),
        out.stride(1),
        GROUP=group,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_G=block_g,
        BLOCK_N=32 if block_d >= 256 else 64,
        BLOCK_D=block_d,
        SOFTCAP=softcap > 0.0,
        DOT_PRECISION=dot_precision(k_cache.dtype),
    )
    return out
