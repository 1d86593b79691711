"""A checkpoint's ``generation_config.json`` as request defaults (vLLM's ``--generation-config``).

What is applied, as vLLM applies it: ``temperature``, ``top_p``, ``top_k``,
``repetition_penalty``, ``min_p`` and ``max_new_tokens`` (as ``max_tokens``), each only when the
file has it (not null); a request's own value always wins. ``eos_token_id`` (an id or a list) joins the ids that end generation.
``do_sample`` is not read: ``do_sample: false`` alone does not make requests greedy (vLLM ignores
it too; a file that wants greedy says ``temperature: 0`` or ``top_k: 1``). ``max_length``
(transformers' prompt + completion cap) and the token ids other than EOS are ignored, as vLLM
ignores them. Sampling settings inferflow does not apply (``typical_p``, ``no_repeat_ngram_size``,
...) are kept in ``not_applied`` when they differ from their neutral value: logged once when the
checkpoint loads (``warn_not_applied``) and shown on ``/version``, never silently dropped.

Modes (``model.generation_config``, ``LLM(generation_config=...)``): ``"auto"`` reads the
checkpoint's file (none there: no defaults), ``"none"`` reads nothing (no defaults, no extra EOS
ids), anything else is a folder holding the ``generation_config.json`` to read.

``GenerationDefaults`` is computed once per model when it loads; the request pipeline and the
engine read it, nothing writes it back.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inferflow.json_types import JSONValue
from inferflow.models.errors import CheckpointError
from inferflow.sampling_params import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param)
APPLIED = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
           "repetition_penalty": "repetition_penalty", "min_p": "min_p",
           "max_new_tokens": "max_tokens"}
# Sampling settings a file may hold that inferflow cannot apply -> their neutral value.
NOT_APPLIED: dict[str, float | None] = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0,
    "encoder_repetition_penalty": 1.0, "min_new_tokens": 0, "min_length": 0, "num_beams": 1,
    "num_beam_groups": 1, "penalty_alpha": None, "bad_words_ids": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What one model's generation config contributes (see the module docstring).

    ``source``: ``"auto"``, ``"none"`` or the name of the folder read (not its path).
    ``applied``: SamplingParams field -> default (only what the file sets).
    ``not_applied``: file key -> value inferflow cannot apply. ``eos_token_ids``: extra EOS ids.
    """

    source: str = "auto"
    applied: Mapping[str, Any] = field(default_factory=dict)
    not_applied: Mapping[str, JSONValue] = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    def get(self, name: str, fallback: float) -> float:
        """The default of SamplingParams field ``name`` (``fallback`` when the file has none)."""
        return self.applied.get(name, fallback)

    @property
    def max_tokens(self) -> int | None:
        return self.applied.get("max_tokens")

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with these defaults (vLLM's ``LLM.get_default_sampling_params``)."""
        return SamplingParams(**{**self.applied, **overrides})

    def describe(self) -> dict[str, object]:
        """For ``GET /version``."""
        return {
            "source": self.source,
            "applied": dict(self.applied),
            "not_applied": dict(self.not_applied),
            "eos_token_ids": list(self.eos_token_ids),
        }


def load_generation_defaults(checkpoint: Path | str, mode: str = "auto") -> GenerationDefaults:
    """Read the generation config of the checkpoint folder ``checkpoint`` in ``mode``; a
    malformed file is a ``CheckpointError`` naming it and the key."""
    if mode == "none":
        return GenerationDefaults(source="none")
    if mode == "auto":
        path = Path(checkpoint) / FILE
        if not path.is_file():
            return GenerationDefaults(source="auto")
        source = "auto"
    else:
        folder = Path(mode).expanduser()
        path = folder / FILE
        if not path.is_file():
            raise CheckpointError(path, "missing (generation_config names this folder)")
        source = folder.resolve().name
    return parse_generation_config(path, source)


def parse_generation_config(path: Path, source: str) -> GenerationDefaults:
    """``path`` (a generation_config.json) as GenerationDefaults."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(path, f"cannot be parsed ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(path, "must hold a JSON object")
    applied: dict[str, Any] = {APPLIED[k]: _number(path, k, v) for k, v in raw.items()
                               if k in APPLIED and v is not None}
    try:
        SamplingParams(**applied)  # the ranges a request's values must be in
    except SamplingParamsError as exc:
        key = {v: k for k, v in APPLIED.items()}.get(exc.field, exc.field)
        raise CheckpointError(path, f"{key}: {str(exc).partition(': ')[2]}") from None
    not_applied = {k: v for k, v in raw.items()
                   if k in NOT_APPLIED and v is not None and v != NOT_APPLIED[k] and v != []}
    return GenerationDefaults(source, applied, not_applied, _eos_ids(path, raw.get("eos_token_id")))


def _number(path: Path, key: str, value: object) -> int | float:
    integral = APPLIED[key] in ("top_k", "max_tokens")
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
        kind = "an integer" if integral else "a number"
        raise CheckpointError(path, f"{key}: must be {kind}, got {value!r}")
    return value if integral else float(value)


def _eos_ids(path: Path, value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    given = [value] if not isinstance(value, list) else value
    ids = [i for i in given if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
    if len(ids) != len(given):
        raise CheckpointError(
            path, f"eos_token_id: must be a token id or a list of them, got {value!r}"
        )
    return tuple(sorted(set(ids)))


def warn_not_applied(defaults: GenerationDefaults, model: str) -> None:
    """One warning naming the settings of the generation config inferflow does not apply."""
    if defaults.not_applied:
        settings = ", ".join(f"{k}={v!r}" for k, v in defaults.not_applied.items())
        logger.warning(
            "%s: generation_config.json sets %s, which inferflow cannot apply: requests sample "
            "without them (shown on /version)", model, settings,
        )
