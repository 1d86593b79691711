"""Sizing the default dataset to the server's context, before anything is sent.

A prompt of the dataset's default length (1,024 words for ``random``) plus ``--output-len`` can
exceed a small model's context: every request would then fail with a 400. The bench reads the
served ``max_model_len`` from ``/v1/models`` (inferflow and vLLM both report it) and shrinks a
*default* input length to fit; lengths the user chose are checked instead (with a tokenizer, the
lengths are tokens; without one they are words, counted as up to ``WORD_TOKENS`` tokens each).
"""

from __future__ import annotations

import dataclasses
import math

import httpx

from inferflow.bench.datasets import DEFAULT_INPUT_LEN, DEFAULT_PREFIX_LEN, DatasetConfig

WORD_TOKENS = 4  # a random word is at most this many BPE tokens (a safe bound, not a guess)
CHAT_OVERHEAD = 32  # tokens a chat template may add around the prompt


def served_max_model_len(base_url: str, model: str, headers: dict[str, str]) -> int | None:
    """``max_model_len`` of ``model`` on ``/v1/models``; None when the server does not say."""
    try:
        response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
        response.raise_for_status()
        cards = response.json().get("data", [])
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    for card in cards:
        if isinstance(card, dict) and card.get("id") == model:
            value = card.get("max_model_len")
            return int(value) if isinstance(value, int) and value > 0 else None
    return None


def fit_to_context(
    config: DatasetConfig, max_model_len: int | None, tokens_per_unit: int
) -> DatasetConfig:
    """``config`` with a default input length shrunk so prompt + output fits ``max_model_len``.

    Raises ``ValueError`` (one line, naming the flags) when lengths the user set cannot fit.
    """
    if max_model_len is None:
        return config
    budget = max_model_len - config.output_len - CHAT_OVERHEAD
    if budget < tokens_per_unit:
        raise ValueError(
            f"--output-len {config.output_len} leaves no room for a prompt in the server's "
            f"max_model_len {max_model_len}; lower --output-len"
        )
    spread = 1.0 + config.range_ratio  # the longest prompt of the spread
    prefix = DEFAULT_PREFIX_LEN[config.name] if config.prefix_len is None else config.prefix_len
    input_len = DEFAULT_INPUT_LEN[config.name] if config.input_len is None else config.input_len
    need = math.ceil((input_len * spread + prefix) * tokens_per_unit)
    if need <= budget:
        return config
    if config.input_len is not None and tokens_per_unit == 1:
        raise ValueError(
            f"--input-len {input_len} (+ prefix {prefix}, range ratio {config.range_ratio}) and "
            f"--output-len {config.output_len} exceed the server's max_model_len {max_model_len}; "
            "lower --input-len or --output-len"
        )
    if config.input_len is not None:  # words: the user chose it, and it may still fit
        return config
    fitted = math.floor((budget / tokens_per_unit - prefix) / spread)
    if fitted < 1:
        raise ValueError(
            f"the {config.name} dataset's prefix ({prefix}) does not fit the server's "
            f"max_model_len {max_model_len}; set --prefix-len and --input-len"
        )
    return dataclasses.replace(config, input_len=fitted)
