"""How much KV memory the engine may reserve (``executor.kv_cache_memory``) and what fits in it.

The slot executors (ONNX Runtime, TensorRT) reserve, per layer, K and V for ``max_slots`` slots
of ``max_model_len`` positions plus the block pool behind the prefix cache and admission
(``num_blocks`` x ``block_size`` positions; by default as many as the slots). Unbounded, a long
context reserves far more address space than the machine has (16 slots x 131,072 positions of a
1B Llama: 260 GiB); Linux overcommit hides it until the pages are touched, and then the OOM
killer ends the server instead of admission queueing requests. So the served ``max_model_len``
is capped to what the budget holds:

    bytes per token = 2 (K, V) x layers x kv_heads x head_dim x activation itemsize
    reserved        = (max_slots x max_model_len + num_blocks x block_size) x bytes per token

and admission, which already counts every running token against the pool's blocks, keeps what
is committed inside the same budget.

A paged executor (ONNX Runtime's ``paged`` form, torch) keeps KV only in the pool, so the budget is the pool:
``num_blocks = budget // (block_size x bytes per token)``, and the served ``max_model_len`` is
capped only by what one sequence can hold (the whole pool); how many sequences run at once is
decided by admission, block by block (``paged_context``). The default budget (``kv_cache_memory: auto``) is half of
the physical memory left after the weights (their size on disk); ``auto/N``, the default of each
engine when a model repository serves N LLMs, is an N-th of what one engine alone takes at
``auto``: of that half, or, when the half is more than the engine's layout reserves (the
slots at full length and their pool; a paged pool of twice what the slots need), of what the
layout reserves (``KVBudget.shared``). So N engines together hold what one would.

ONNX Runtime's paged pool is made resident before the engine reports ready, so its ``auto`` is
sized from the model, not the machine: twice the weights, at least 64 MiB (still at most the
half above and what the layout can use). The default tiny model gets 64 MiB (16,384 tokens);
the ~100M f32 model ~0.8 GB (~33,000 tokens). A larger pool is ``executor.kv_cache_memory=4GiB``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from inferflow.config.base import AUTO, auto_share, parse_memory
from inferflow.models.config import ModelArch
from inferflow.scheduling.layout import KVLayout

MIN_AUTO_BYTES = 256 * 1024**2
# ``auto`` for a paged pool that is made resident at load: twice the weights, at least this
MIN_PAGED_AUTO_BYTES = 64 * 1024**2


def physical_memory_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def weights_bytes(files: Iterable[Path]) -> int:
    return sum(f.stat().st_size for f in files if f.exists())


def kv_bytes_per_token(arch: ModelArch, itemsize: int) -> int:
    return 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * itemsize


@dataclass(frozen=True)
class KVBudget:
    """``bytes`` of KV at ``bytes_per_token``; ``source`` says where the number came from."""

    bytes: int
    bytes_per_token: int
    source: str
    auto: bool = False  # the default share of memory, not a size the user gave
    share: int = 1  # auto/N: N engines share what one alone would take

    @property
    def tokens(self) -> int:
        return self.bytes // self.bytes_per_token

    @classmethod
    def resolve(cls, setting: str | int | None, bytes_per_token: int, model_bytes: int,
                paged: bool = False) -> KVBudget:
        """An explicit size, or ``auto[/N]``: half of the physical memory after the weights
        (an N-th of that); for a ``paged`` pool that the engine makes resident at load, at
        most twice the weights (at least ``MIN_PAGED_AUTO_BYTES``), so a small model gets a
        small pool and its memory follows the model, not the machine."""
        explicit = parse_memory(setting)
        if explicit is not None:
            return cls(explicit, bytes_per_token, f"executor.kv_cache_memory={setting}")
        share = auto_share(setting) or 1
        half = (physical_memory_bytes() - model_bytes) // 2 // share
        what = "half" if share == 1 else f"1/{2 * share}"
        source = f"({what} of the physical memory after the weights)"
        auto = max(MIN_AUTO_BYTES, half)
        if paged:
            pool = max(MIN_PAGED_AUTO_BYTES, 2 * model_bytes) // share
            if pool < auto:
                auto, source = pool, f"(twice the weights, at least {human(MIN_PAGED_AUTO_BYTES)}" \
                    + (f", 1/{share}" if share > 1 else "") + ")"
        return cls(auto, bytes_per_token, f"executor.kv_cache_memory={setting or AUTO} {source}",
                   auto=True, share=share)

    def shared(self, alone_tokens: int) -> KVBudget:
        """``auto/N`` against a layout that reserves ``alone_tokens`` when nothing binds it:
        at most an N-th of those (one engine alone at ``auto`` reserves no more than them,
        however much memory is free). Any other budget: itself."""
        cap = alone_tokens * self.bytes_per_token // self.share
        if not self.auto or self.share <= 1 or cap >= self.bytes:
            return self
        return replace(self, bytes=cap, source=(
            f"executor.kv_cache_memory=auto/{self.share}: 1/{self.share} of the "
            f"{human(alone_tokens * self.bytes_per_token)} one engine alone reserves"
        ))

    def max_model_len(self, max_slots: int, block_size: int, num_blocks: int) -> int:
        """The longest slot that fits: the slots and the pool share the budget (an automatic
        pool is as large as the slots)."""
        if num_blocks:
            room = self.tokens - num_blocks * block_size
            per_slot = room // max_slots
        else:
            per_slot = self.tokens // (2 * max_slots)
        return max(0, per_slot // block_size * block_size)

    def describe(self) -> str:
        return f"{human(self.bytes)} ({self.source}; {self.bytes_per_token} bytes of KV per token)"


def human(n: int) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class ServedContext:
    """The context a server serves: ``wanted`` (config and checkpoint), lowered to ``served``
    when ``slots`` slots of it and the prefix pool do not fit ``budget``."""

    wanted: int
    served: int
    slots: int
    budget: KVBudget | None = None
    num_blocks: int = 0  # the block pool's size when the budget decides it (paged); 0 = cache's

    def note(self) -> str | None:
        """One line when the budget lowered the context (else None)."""
        if self.budget is None or self.served >= self.wanted:
            return None
        if self.num_blocks:
            return (
                f"model.max_model_len {self.wanted} is more than the whole paged KV pool, "
                f"{self.budget.describe()} = {self.num_blocks} blocks: serving "
                f"max_model_len={self.served}. Raise executor.kv_cache_memory for longer contexts."
            )
        return (
            f"model.max_model_len {self.wanted} does not fit the KV budget "
            f"{self.budget.describe()} with {self.slots} slots and the prefix pool: serving "
            f"max_model_len={self.served}. Raise executor.kv_cache_memory or lower "
            "batching.max_num_seqs for longer contexts."
        )


def served_context(
    wanted: int, slots: int, block_size: int, num_blocks: int, budget: KVBudget | None
) -> ServedContext:
    """What ``budget`` lets ``slots`` slots serve of ``wanted``; ``ValueError`` when it holds
    less than two blocks per slot."""
    if budget is None:
        return ServedContext(wanted, wanted, slots)
    pool = num_blocks * block_size or slots * -(-wanted // block_size) * block_size
    budget = budget.shared(slots * wanted + pool)
    fit = budget.max_model_len(slots, block_size, num_blocks)
    if fit < 2 * block_size:
        raise ValueError(
            f"executor.kv_cache_memory: the KV budget, {budget.describe()}, holds "
            f"{budget.tokens} tokens: not enough for {slots} slots and the prefix pool; "
            "raise it or lower batching.max_num_seqs / cache.num_blocks"
        )
    return ServedContext(wanted, min(wanted, fit), slots, budget)


def paged_context(
    wanted: int,
    slots: int,
    block_size: int,
    num_blocks: int,
    budget: KVBudget | None,
    window_need: int = 0,
) -> ServedContext:
    """A paged pool: ``num_blocks`` from the budget (an explicit ``cache.num_blocks`` wins; no
    budget and no count = one full sequence per slot), the context capped at the pool's size.
    An ``auto`` budget takes at most twice what ``slots`` full-length sequences need (every
    running sequence at full length, and as much again for cached prefixes). ``window_need``:
    the most blocks a sequence holds under a sliding window whose blocks are freed
    (``scheduling.config.blocks_per_window``; 0: none); a pool that holds them does not cap
    the context."""
    blocks = num_blocks
    if not blocks and budget is not None:
        budget = budget.shared(2 * slots * -(-wanted // block_size) * block_size)
        blocks = budget.tokens // block_size
        if budget.auto:
            blocks = min(blocks, 2 * slots * -(-wanted // block_size))
        if blocks < 2:
            raise ValueError(
                f"executor.kv_cache_memory: the KV budget, {budget.describe()}, holds "
                f"{budget.tokens} tokens: less than two blocks of {block_size}; raise it"
            )
    if not blocks:
        blocks = slots * -(-wanted // block_size)
    served = min(wanted, blocks * block_size)
    if window_need and blocks >= window_need:
        served = wanted
    return ServedContext(wanted, served, slots, budget, blocks)


def describe_layout(layout: KVLayout, budget: KVBudget | None) -> str:
    """One line for ``task=check``: the paged pool, or the slots and their pool, and the budget."""
    pool = f"{layout.num_blocks} blocks x {layout.block_size} tokens"
    if layout.paged:
        where = ""
        if budget is not None:
            size = human(layout.num_blocks * layout.block_size * budget.bytes_per_token)
            where = f" = {size} (budget: {budget.describe()})"
        window = layout.freeing_window
        freed = f"; blocks behind the {window}-token window are freed" if window else ""
        return f"paged, {pool}{where}; up to {layout.max_slots} sequences{freed}"
    where = f" in {budget.describe()}" if budget is not None else ""
    return f"{layout.max_slots} slots x {layout.max_model_len} positions + a pool of {pool}{where}"
