"""Triton paged decode attention: one query token per row, KV read through block tables.

One program per (row, query head): it walks the row's blocks in order, loads each block's
``S x D`` keys and values of its KV head (GQA: query head h reads KV head h // (Hq / Hkv)), and
keeps an online softmax (running max, running sum, accumulator), FlashAttention-style. No host
synchronisation: the loop bound is read on the device from ``seq_lens``, so a decode step can be
captured in a CUDA graph. Shapes as in ``attention.py``; ``S`` and ``D`` are padded to powers of
two inside the kernel (masked).

Sliding windows and soft-capping are computed here, not routed elsewhere: with ``window`` W > 0
the walk starts at the block holding position ``seq_len - W`` (the first key the query at
``seq_len - 1`` sees) and masks the positions before it, so a windowed decode reads at most
``W / S + 1`` blocks whatever the sequence length; with ``softcap`` > 0 the scaled scores go
through ``softcap * tanh(s / softcap)`` (tanh as ``2 * sigmoid(2x) - 1``, float32) before the
online softmax.

Tested on CPU under ``TRITON_INTERPRET=1`` against ``attention.reference_attention``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_NO_WINDOW = 2**30  # window 0 (none) as one wider than any context: lo = max(seq_len - W, 0) = 0


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr,
    scale, window, softcap,
    stride_qn, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_on, stride_oh,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SOFTCAP: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_S)
    d_mask = offs_d < HEAD_DIM
    s_mask = offs_s < BLOCK_SIZE
    q = tl.load(q_ptr + row * stride_qn + head * stride_qh + offs_d, mask=d_mask, other=0.0)
    q = q.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + row)
    lo = tl.maximum(seq_len - window, 0)  # the first visible position (the query: seq_len - 1)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for blk in range(lo // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(block_tables_ptr + row * stride_bt + blk).to(tl.int64)
        pos = blk * BLOCK_SIZE + offs_s
        valid = s_mask & (pos < seq_len) & (pos >= lo)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_cache_ptr + block_id * stride_kb + offs_s[:, None] * stride_ks
            + kv_head * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if SOFTCAP:
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_cache_ptr + block_id * stride_vb + offs_s[:, None] * stride_vs
            + kv_head * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + row * stride_on + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """q (B, Hq, D) -> (B, Hq, D); every row decodes one token against ``seq_lens[b]`` positions
    of KV (already written) in the blocks of ``block_tables[b]`` (the last ``window`` of them
    where ``window`` > 0; scores soft-capped where ``softcap`` > 0)."""
    rows, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q)
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("paged_decode_attention: the head dim must be contiguous")
    tables = block_tables.contiguous()
    _paged_decode_kernel[(rows, num_heads)](
        q, k_cache, v_cache, tables, seq_lens, out,
        scale, window if window > 0 else _NO_WINDOW, softcap,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(block_size), BLOCK_D=triton.next_power_of_2(head_dim),
        SOFTCAP=softcap > 0.0,
    )
    return out
