"""Paged attention: one custom op that writes a step's K/V into the blocks and attends through
block tables.

Shapes: N packed tokens of the step, B rows (sequences), W block-table width, P physical blocks
(the pool plus one scratch block that padding writes into), S block size, Hq/Hkv heads, D head
dim.

    q             (N, Hq, D)   this step's queries, row after row (rotary applied)
    k, v          (N, Hkv, D)  this step's keys and values
    k_cache       (P, S, Hkv, D)  one layer's physical blocks (v_cache alike); written in place;
                  the op finds them in ``KV_CACHES`` by (cache id, layer), not as arguments
    slot_mapping  (N,) int64   flat cache position of each token: block_id * S + offset
    block_tables  (B, W) int32 row b's blocks in position order (padded with any valid id)
    seq_lens      (B,) int32   row b's KV length after the step (cached + new tokens)
    query_start   (B + 1,) int32  row b's tokens are q[query_start[b]:query_start[b + 1]]

Row b's queries sit at the last ``q_len`` positions of its ``seq_len`` and attend causally to
every position up to their own. The op is opaque to ``torch.compile`` (a custom op with a fake
implementation), so Inductor compiles everything around it as one graph.

Implementations: on CPU (and for steps with prefill chunks on CUDA) a gather of each row's
blocks plus ``scaled_dot_product_attention``, decode rows batched in one call; on CUDA a
decode-only step runs the Triton kernel of ``triton_paged.py``, which needs no host
synchronisation and so can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(B, W * S, Hkv, D): each row's blocks laid end to end (position order)."""
    b, w = block_tables.shape
    _, s, hkv, d = cache.shape
    return cache[block_tables.long()].reshape(b, w * s, hkv, d)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over cached KV (already written) by gather + SDPA; (N, Hq, D)."""
    out = torch.empty_like(q)
    starts = query_start.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    if decode:  # one batched call: (Bd, Hq, 1, D) against (Bd, Hkv, L, D), masked to seq_len
        rows = torch.tensor(decode, device=q.device)
        keys = gather_kv(k_cache, block_tables[rows]).transpose(1, 2)
        values = gather_kv(v_cache, block_tables[rows]).transpose(1, 2)
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = positions[None, :] < seq_lens[rows].to(positions.dtype)[:, None]  # (Bd, L)
        token = query_start[rows].long()
        attn = F.scaled_dot_product_attention(
            q[token].unsqueeze(2), keys, values, attn_mask=mask[:, None, None, :],
            scale=scale, enable_gqa=True,
        )
        out[token] = attn.squeeze(2)
    for b in range(len(lens)):
        start, end, ctx = starts[b], starts[b + 1], lens[b]
        q_len = end - start
        if q_len <= 1:
            continue
        n_blocks = -(-ctx // k_cache.shape[1])
        table = block_tables[b : b + 1, :n_blocks]
        keys = gather_kv(k_cache, table)[:, :ctx].transpose(1, 2)  # (1, Hkv, ctx, D)
        values = gather_kv(v_cache, table)[:, :ctx].transpose(1, 2)
        # query i is at position ctx - q_len + i and sees keys 0..that position
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= query_pos[:, None]  # (q_len, ctx)
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0), keys, values, attn_mask=mask,
            scale=scale, enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out


def write_kv(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter (N, Hkv, D) into the flat token positions ``slot_mapping`` of (P, S, Hkv, D)."""
    p, s, hkv, d = cache.shape
    cache.view(p * s, hkv, d).index_copy_(0, slot_mapping, new)


class KVCacheRegistry:
    """The engines' KV blocks, found by the op through ids instead of tensor arguments.

    Why not pass the caches as mutated arguments: ``torch.compile`` functionalizes a custom op
    that mutates its inputs, and where it cannot prove the mutation may happen in place (frozen
    buffers, for one) it copies the whole cache on every call, a cost that grows with the pool
    (measured: 29 -> 75 ms per decode step going from 512 to 8,192 blocks). vLLM does the same:
    its attention op reads the cache from a forward context. The op mutates nothing it is
    given, so the compiler keeps it as an opaque call in program order.
    """

    def __init__(self) -> None:
        self._caches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._next = 0

    def register(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        self._next += 1
        self._caches[self._next] = layers
        return self._next

    def release(self, cache_id: int) -> None:
        self._caches.pop(cache_id, None)

    def get(self, cache_id: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._caches[cache_id][layer]


KV_CACHES = KVCacheRegistry()


@torch.library.custom_op("inferflow::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    cache_id: int,
    layer: int,
    scale: float,
    decode_only: bool,
) -> torch.Tensor:
    """Write k/v into layer ``layer`` of the registered cache ``cache_id``, then attend (see the
    module docstring); (N, Hq, D)."""
    k_cache, v_cache = KV_CACHES.get(cache_id, layer)
    write_kv(k_cache, k, slot_mapping)
    write_kv(v_cache, v, slot_mapping)
    if decode_only and q.is_cuda:
        from inferflow.runtimes.torch_engine.triton_paged import paged_decode_attention

        return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale)
    return reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale)


@paged_attention.register_fake
def _(q, k, v, slot_mapping, block_tables, seq_lens, query_start, cache_id, layer, scale,
      decode_only):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)
