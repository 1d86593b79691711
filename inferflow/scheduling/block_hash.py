"""Prefix-cache keys of full KV blocks.

key(block i) = (sha256(key(block i-1).digest, block i's token ids, extra keys), token ids, extra keys).
The digest chains the whole prefix; the token ids and extra keys are kept in the key and compared on
lookup, so two different blocks can only collide if their parents' 256-bit digests do.
Only *full* blocks have keys: a partial block's content is still changing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import NamedTuple

ExtraKeys = tuple[str | int, ...]  # e.g. (model name, LoRA id): content that changes the KV


class BlockKey(NamedTuple):
    digest: bytes  # sha256 over (parent digest, token_ids, extra_keys)
    token_ids: tuple[int, ...]
    extra_keys: ExtraKeys = ()


_ROOT = b"inferflow-kv-root"


def hash_block(
    parent: BlockKey | None, token_ids: Sequence[int], extra_keys: ExtraKeys = ()
) -> BlockKey:
    """Key of one full block whose parent (previous block of the same sequence) is ``parent``."""
    h = hashlib.sha256(_ROOT if parent is None else parent.digest)
    h.update(array("q", token_ids).tobytes())
    h.update(repr(extra_keys).encode())
    return BlockKey(h.digest(), tuple(token_ids), extra_keys)


def extend_block_keys(
    keys: list[BlockKey],
    token_ids: Sequence[int],
    num_tokens: int,
    block_size: int,
    extra_keys: ExtraKeys = (),
) -> list[BlockKey]:
    """Append to ``keys`` (in place) the keys of every full block within ``token_ids[:num_tokens]``.

    ``keys`` holds the keys already computed for this sequence (a prefix of the result), so a
    decoding sequence hashes each block once.
    """
    for i in range(len(keys), num_tokens // block_size):
        parent = keys[-1] if keys else None
        keys.append(
            hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra_keys)
        )
    return keys
