"""How an offline engine (``LLMEngine.from_path``, ``LLM``) is sized: as the server sizes its
engine by default. The batching budgets come from the server's batching stage for the mode; the
served context from the executor's KV budget (``ServingGraph.served_context`` does the same for
the server; ``scheduling/kv_budget.py``)."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from inferflow.models.checkpoint import Checkpoint
from inferflow.runtimes.config import EngineConfig
from inferflow.stages.executor import executor_for

if TYPE_CHECKING:
    from inferflow.stages.batching import BatchingStage

logger = logging.getLogger(__name__)


def server_batching(mode: str) -> BatchingStage:
    """The server's batching stage for ``mode``, with its default budgets."""
    from inferflow.stages.batching import ContinuousBatching, NoBatching, StaticBatching

    stages: dict[str, type[BatchingStage]] = {
        "continuous": ContinuousBatching, "static": StaticBatching, "none": NoBatching}
    if mode not in stages:
        raise ValueError(f"mode: must be 'continuous', 'static' or 'none', got {mode!r}")
    return stages[mode]()


def budgeted_context(checkpoint: Checkpoint, config: EngineConfig, wanted: int | None,
                      kv_cache_memory: str | int | None) -> int:
    """``wanted`` (default: the checkpoint's context), lowered so that ``config.max_slots``
    slots of it and the prefix pool fit the executor's KV budget, as the server sizes them
    (``ServingGraph.served_context``; ``scheduling/kv_budget.py``)."""
    from inferflow.scheduling.kv_budget import served_context, weights_bytes

    executor = executor_for(config)
    if kv_cache_memory is not None:
        executor = dataclasses.replace(executor, kv_cache_memory=str(kv_cache_memory))
    arch = checkpoint.config
    limit = arch.max_position_embeddings
    budget = executor.kv_budget(arch, weights_bytes(checkpoint.shards))
    try:
        context = served_context(min(limit, wanted or limit), config.max_slots, config.block_size,
                                 config.num_blocks, budget)
    except ValueError as exc:  # named as the keywords here, not as the server's config keys
        message = str(exc).replace("executor.kv_cache_memory", "kv_cache_memory")
        raise ValueError(message.replace("batching.max_num_seqs", "max_num_seqs").replace(
            "cache.num_blocks", "num_blocks")) from None
    if context.served < context.wanted:
        assert budget is not None
        logger.warning(
            "max_model_len %d does not fit the KV budget, %s, with %d slots and the prefix pool: "
            "running max_model_len=%d; pass kv_cache_memory= (e.g. '8GiB') or a smaller "
            "max_num_seqs for longer contexts", context.wanted, budget.describe(),
            config.max_slots, context.served)
    return context.served
