"""The scheduler's KV plans on the real ONNX Runtime engine, on slots (prefix-cache block copies)
and on the paged pool (shared blocks): prefix hits and preemption by recompute must not change a
single greedy token."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import ORT_FORMS, PROMPTS, make_named_checkpoint, run_greedy

from inferflow import LLM
from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.checkpoint import load_checkpoint
from inferflow.scheduling.integrity import check_scheduler

SYSTEM = "System: You are a helpful assistant. Answer briefly and truthfully, please. " * 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_named_checkpoint(tmp_path_factory.mktemp("sched_real"), "gqa8x2")


@pytest.fixture(params=ORT_FORMS)
def form(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def clobber_slots(engine: LLMEngine) -> None:
    """Overwrite every slot's KV, as other requests reusing the slots would: from here on only
    the block pool holds the cached prefix, so a hit must really copy it back. (Paged: nothing
    to clobber, a hit reads the shared blocks themselves.)"""
    for k, v in getattr(engine.engine, "kv", ()):
        k[...] = 7.0
        v[...] = -7.0


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, together: bool) -> list[list[int]]:
    return run_greedy(engine, prompts, max_tokens, together, after_each=clobber_slots)


def make(ckpt: Path, form: str, *, prefix: bool, num_blocks: int = 0, slots: int = 4) -> LLMEngine:
    return LLM(ckpt, max_slots=slots, max_model_len=256, block_size=8, num_blocks=num_blocks,
               max_num_batched_tokens=48, enable_prefix_caching=prefix, graph_form=form).engine


def test_prefix_hit_prefills_only_the_suffix_and_changes_nothing(ckpt: Path, form: str) -> None:
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(SYSTEM + q) for q in PROMPTS]
    cached = make(ckpt, form, prefix=True)
    with_cache = run(cached, prompts, 16, together=False)
    stats = cached.stats()
    shared = len(tok.encode(SYSTEM)) - 1  # the BOS-prefixed system prompt, in tokens
    # every request after the first found the system prompt's full blocks in the cache
    assert stats.prefix_cache_hits >= (len(prompts) - 1) * (shared // 8) * 8
    assert run(make(ckpt, form, prefix=False), prompts, 16, together=False) == with_cache


def test_preemption_under_memory_pressure_gives_the_same_outputs(ckpt: Path, form: str) -> None:
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(p * 3) for p in PROMPTS]
    roomy = run(make(ckpt, form, prefix=False), prompts, 40, together=True)
    # 4 sequences of ~60-100 tokens need ~40 blocks of 8; 20 forces preemption by recompute
    tight = make(ckpt, form, prefix=False, num_blocks=20)
    assert run(tight, prompts, 40, together=True) == roomy
    assert tight.stats().num_preemptions > 0
    check_scheduler(tight.scheduler)
