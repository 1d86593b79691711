"""The embedded default ``tiny_llama`` has learned language: held-out perplexity, and how often
its int8 and int4 engines pick fp32's next token on held-out text (teacher-forced).

The held-out text ships with the model (``inferflow/models/tiny_llama/heldout.txt``: Python
documentation files the training never saw, ``scripts/train_tiny_llama.py``).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_factories import make_engine

from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.tiny import TRAINED, tiny_llama_path
from inferflow.runtimes.step_inputs import EngineRow

pytestmark = pytest.mark.slow

WINDOWS, LENGTH = 8, 64  # 8 held-out windows of 64 tokens: 504 predicted positions


@pytest.fixture(scope="module")
def windows() -> list[list[int]]:
    ids = load_checkpoint(tiny_llama_path()).tokenizer.encode((TRAINED / "heldout.txt").read_text())
    step = len(ids) // WINDOWS
    assert step >= LENGTH
    return [ids[i * step:i * step + LENGTH] for i in range(WINDOWS)]


def teacher_forced_logits(engine, windows: list[list[int]]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """(positions, V): the logits after every prefix of every window (one row per prefix)."""
    return np.stack([engine.forward([EngineRow(0, tuple(w[:p]), 0, True)])[0]
                     for w in windows for p in range(1, len(w))])


def targets(windows: list[list[int]]) -> np.ndarray:
    return np.array([w[p] for w in windows for p in range(1, len(w))])


def test_held_out_perplexity_shows_a_trained_model(windows: list[list[int]]) -> None:
    logits = teacher_forced_logits(make_engine(tiny_llama_path(), max_model_len=128), windows)
    shifted = logits - logits.max(-1, keepdims=True)
    logprobs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    y = targets(windows)
    perplexity = float(np.exp(-logprobs[np.arange(len(y)), y].mean()))
    top1 = float((logits.argmax(-1) == y).mean())
    vocab = logits.shape[-1]
    print(f"held-out perplexity {perplexity:.1f}, top-1 {top1:.1%} (vocabulary {vocab})")
    reported = json.loads((TRAINED / "training.json").read_text())["heldout_perplexity"]
    assert perplexity < vocab / 40  # a random model of this vocabulary: ~vocab
    assert perplexity < 2 * reported and top1 > 0.2


def test_int8_and_int4_agree_with_fp32_on_held_out_text(windows: list[list[int]]) -> None:
    reference = teacher_forced_logits(make_engine(tiny_llama_path(), max_model_len=128), windows)
    agreement = {}
    for precision in ("int8", "int4"):
        engine = make_engine(tiny_llama_path(), precision=precision, max_model_len=128)
        top1 = teacher_forced_logits(engine, windows).argmax(-1)
        agreement[precision] = float((top1 == reference.argmax(-1)).mean())
    print(f"top-1 agreement with fp32: {agreement}")
    assert agreement["int8"] >= 0.99
    assert agreement["int4"] >= 0.90
