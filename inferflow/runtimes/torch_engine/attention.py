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
every position up to their own; with a sliding ``window`` W > 0 (the layer's
``ModelArch.window``), the query at position p sees key j iff ``p - W < j <= p``. A ``softcap``
> 0 (Gemma 2) maps the scaled scores s to ``softcap * tanh(s / softcap)`` before the mask and
the softmax. The op is opaque to ``torch.compile`` (a custom op with a fake implementation), so
Inductor compiles everything around it as one graph.

Windowed layers and the paged layout: a windowed layer's KV is written to the same blocks as
every other layer's (one block table per sequence, shared by all layers), so its blocks are kept
for the whole sequence; the window only decides which positions are read (the reference path
gathers only the blocks from the first visible one on, the Triton kernel starts its walk
there). Freeing the blocks that lie wholly outside *every* layer's window is the scheduler's
business (the KV manager), not this op's: a block table may then hold any id in those places,
since no query reads them.

Implementations, chosen by the device: on CPU ``reference_attention``, a gather of each row's
blocks plus ``scaled_dot_product_attention`` (an explicit float32 matmul/softmax for soft-capped
layers: SDPA cannot soft-cap), decode rows batched in one call, prefill rows one by one (it reads
the row lengths on the host); on CUDA the Triton kernels, windows and soft-capping included, with
no host synchronisation: a decode-only step runs the split-K decode kernel of
``triton_paged.py`` (captured in CUDA graphs), a step with prefill chunks (mixed with decodes or
not) the varlen extend kernel of ``triton_extend.py``, every row in one launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """(B, W * S, Hkv, D): each row's blocks laid end to end (position order)."""
    b, w = block_tables.shape
    _, s, hkv, d = cache.shape
    return cache[block_tables.long()].reshape(b, w * s, hkv, d)


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """(..., Lq, L) bool: key j is seen by the query at p iff j <= p and (window) p - W < j.
    ``query_pos`` (..., Lq), ``key_pos`` (..., L); the leading dims broadcast."""
    diff = query_pos[..., :, None] - key_pos[..., None, :]  # p - j
    mask = diff >= 0
    if window > 0:
        mask = mask & (diff < window)
    return mask


def _decode_blocks(tables: torch.Tensor, lens: torch.Tensor, block_size: int,
                   window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks decode rows read, (Bd, Wd), and their keys' positions, (Bd, Wd * S).

    Without a window, the whole table. With one, from the block holding each row's first
    visible position (``seq_len - window``) on, ``Wd = ceil(window / S) + 1`` blocks (all a
    window can touch), so a windowed decode gathers the same few blocks at any length; columns
    past the table's end repeat its last one, at positions past the query's (masked)."""
    width = tables.shape[1]
    steps = torch.arange(width, device=tables.device)
    if window <= 0:
        return tables, torch.arange(width * block_size, device=tables.device)[None, :]
    span = min(width, -(-window // block_size) + 1)
    first = (lens - window).clamp(min=0) // block_size  # (Bd,)
    cols = first[:, None] + steps[:span]  # (Bd, Wd)
    key_pos = cols[:, :, None] * block_size + torch.arange(block_size, device=tables.device)
    return tables.gather(1, cols.clamp(max=width - 1)), key_pos.reshape(len(lens), -1)


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
           scale: float, softcap: float) -> torch.Tensor:
    """q (B, Hq, Lq, D) over keys/values (B, Hkv, L, D), mask (B, 1, Lq, L) bool -> (B, Hq, Lq, D).

    Without soft-capping: SDPA (GQA by ``enable_gqa``). With it: scores in float32, capped,
    masked, softmaxed, then the values (transformers' eager Gemma 2 attention, in float32)."""
    if softcap <= 0.0:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # (B, Hq, L, D)
    values = values.float().repeat_interleave(group, dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # (B, Hq, Lq, L)
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(dim=-1) @ values).to(q.dtype)


def reference_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention over cached KV (already written) by gather + SDPA; (N, Hq, D). ``window`` 0 and
    ``softcap`` 0.0: none (see the module docstring)."""
    out = torch.empty_like(q)
    starts = query_start.tolist()
    lens = seq_lens.tolist()
    decode = [b for b in range(len(lens)) if starts[b + 1] - starts[b] == 1]
    block_size = k_cache.shape[1]
    if decode:  # one batched call: (Bd, Hq, 1, D) against (Bd, Hkv, L, D), masked to seq_len
        rows = torch.tensor(decode, device=q.device)
        tables, key_pos = _decode_blocks(block_tables[rows], seq_lens[rows].long(), block_size,
                                         window)
        keys = gather_kv(k_cache, tables).transpose(1, 2)
        values = gather_kv(v_cache, tables).transpose(1, 2)
        query_pos = seq_lens[rows].long()[:, None] - 1  # (Bd, 1)
        mask = visible(query_pos, key_pos, window)  # (Bd, 1, L)
        token = query_start[rows].long()
        attn = attend(q[token].unsqueeze(2), keys, values, mask[:, None], scale, softcap)
        out[token] = attn.squeeze(2)
    for b in range(len(lens)):
        start, end, ctx = starts[b], starts[b + 1], lens[b]
        q_len = end - start
        if q_len <= 1:
            continue
        # keys from the first block the row's first query (position ctx - q_len) can see
        first = max(0, ctx - q_len - window + 1) // block_size if window > 0 else 0
        n_blocks = -(-ctx // block_size)
        table = block_tables[b : b + 1, first:n_blocks]
        offset = first * block_size
        keys = gather_kv(k_cache, table)[:, : ctx - offset].transpose(1, 2)  # (1, Hkv, L, D)
        values = gather_kv(v_cache, table)[:, : ctx - offset].transpose(1, 2)
        query_pos = torch.arange(ctx - q_len, ctx, device=q.device)
        key_pos = torch.arange(offset, ctx, device=q.device)
        mask = visible(query_pos, key_pos, window)  # (q_len, L)
        attn = attend(q[start:end].transpose(0, 1).unsqueeze(0), keys, values, mask[None, None],
                      scale, softcap)
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
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Write k/v into layer ``layer`` of the registered cache ``cache_id``, then attend (see the
    module docstring; ``window`` 0: none, ``softcap`` 0.0: none); (N, Hq, D)."""
    k_cache, v_cache = KV_CACHES.get(cache_id, layer)
    write_kv(k_cache, k, slot_mapping)
    write_kv(v_cache, v, slot_mapping)
    if q.is_cuda:  # Triton kernels: no host synchronisation, no Python loop over rows
        if decode_only:
            from inferflow.runtimes.torch_engine.triton_paged import paged_decode_attention

            return paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                          window, softcap)
        from inferflow.runtimes.torch_engine.triton_extend import paged_extend_attention

        return paged_extend_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start,
                                      scale, window, softcap)
    return reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale,
                               window, softcap)


@paged_attention.register_fake
def _(q, k, v, slot_mapping, block_tables, seq_lens, query_start, cache_id, layer, scale,
      decode_only, window=0, softcap=0.0):  # type: ignore[no-untyped-def]
    return torch.empty_like(q)
