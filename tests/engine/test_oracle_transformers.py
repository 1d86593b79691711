"""Token-exact greedy generation and logits against transformers on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_factories import (
    ORT_FORMS,
    PROMPTS,
    greedy,
    make_engine,
    make_named_checkpoint,
    transformers_reference,
)

from inferflow.models.checkpoint import load_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

N_NEW = 32


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oracle_ckpts")


@pytest.fixture(scope="module")
def reference() -> object:
    """(path, prompt) -> transformers greedy tokens and logits of every position; cached."""
    cache: dict[tuple[Path, tuple[int, ...]], tuple[list[int], np.ndarray]] = {}

    def get(path: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
        key = (path, tuple(prompt))
        if key not in cache:
            cache[key] = transformers_reference(path, prompt, N_NEW)
        return cache[key]

    return get


@pytest.mark.parametrize("form", [*ORT_FORMS, "canonical"])
@pytest.mark.parametrize("name", ["gqa8x2", "tied", "bf16", "fp16_sharded", "plain_rope", "qwen2_bias", "mistral",
                                  "ffn1024"])
def test_greedy_tokens_and_logits_match_transformers(ckpt_root: Path, reference, name: str, form: str) -> None:
    path = make_named_checkpoint(ckpt_root, name)
    engine = make_engine(path, graph_form=form)
    tokenizer = load_checkpoint(path).tokenizer
    for prompt_text in PROMPTS[:3]:
        prompt = tokenizer.encode(prompt_text)
        ref_tokens, ref_logits = reference(path, prompt)
        tokens, logits = greedy(engine, prompt, N_NEW)
        assert tokens == ref_tokens, f"{name}/{form}: {prompt_text!r}"
        # prefill logits (last prompt position) and every decode step's logits, fp32
        for k, step_logits in enumerate(logits[:N_NEW]):
            np.testing.assert_allclose(step_logits, ref_logits[len(prompt) - 1 + k], atol=1e-3, rtol=0)


def test_config_variants_are_what_they_claim(ckpt_root: Path) -> None:
    cfg = load_checkpoint(make_named_checkpoint(ckpt_root, "gqa8x2")).config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.rope_theta) == (8, 2, 500000.0)
    assert cfg.rope.rope_type == "llama3" and not cfg.tie_word_embeddings
    assert load_checkpoint(make_named_checkpoint(ckpt_root, "tied")).config.tie_word_embeddings
    sharded = load_checkpoint(make_named_checkpoint(ckpt_root, "fp16_sharded"))
    assert len(sharded.shards) == 3
