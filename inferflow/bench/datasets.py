"""Benchmark datasets: what each request of a run asks.

- ``random``: prompt and output lengths drawn uniformly from ``[floor(L·(1-r)), ceil(L·(1+r))]``
  around ``input_len``/``output_len`` with ``range_ratio`` r in [0, 1) (vLLM's random dataset),
  optionally behind a fixed random prefix of ``prefix_len`` tokens shared by every prompt.
- ``shared-prefix``: ``num_prefixes`` system prompts of ``prefix_len`` tokens, each request one of
  them (round robin) plus its own question of ~``input_len`` tokens: the prefix-cache workload.
- ``long-doc``: a document of ~``input_len`` tokens followed by an instruction; ``num_docs``
  distinct documents reused round robin (``None``: every request its own document).
- ``jsonl``: one request per line of ``path``: ``{"prompt": str}`` or ``{"messages": [...]}``,
  optional ``"output_len"``/``"max_tokens"``; a bare JSON string is a prompt. Lines are cycled
  when ``num_prompts`` exceeds them.
All draws come from one ``numpy`` generator seeded with ``seed``: same config, same requests.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from inferflow.bench.records import SampleRequest
from inferflow.bench.text import TextSource

DATASET_NAMES = ("random", "shared-prefix", "long-doc", "jsonl")
DEFAULT_INPUT_LEN = {"random": 1024, "shared-prefix": 64, "long-doc": 4096, "jsonl": 0}
DEFAULT_PREFIX_LEN = {"random": 0, "shared-prefix": 512, "long-doc": 0, "jsonl": 0}
LONG_DOC_INSTRUCTIONS = (
    "Summarize the document above in three sentences.",
    "List the main topics of the document above.",
    "Which places are mentioned in the document above?",
    "Write a title for the document above.",
)


@dataclass(frozen=True)
class DatasetConfig:
    """How to build a run's requests; ``None`` lengths take the dataset's default."""

    name: str = "random"
    num_prompts: int | None = None  # None: 1000, or every line of a JSONL file
    input_len: int | None = None
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int | None = None
    num_prefixes: int = 1
    num_docs: int | None = None
    path: str | None = None
    seed: int = 0

    def validate(self) -> None:
        if self.name not in DATASET_NAMES:
            raise ValueError(f"dataset must be one of {DATASET_NAMES}, got {self.name!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")
        if self.name == "jsonl" and not self.path:
            raise ValueError("the jsonl dataset needs a path (--dataset-path)")
        if self.num_prefixes < 1 or (self.num_docs is not None and self.num_docs < 1):
            raise ValueError("num_prefixes and num_docs must be >= 1")


def spread(
    length: int, ratio: float, size: int, rng: np.random.Generator, low_min: int
) -> list[int]:
    """``size`` integer lengths uniform in ``[floor(L(1-r)), ceil(L(1+r))]``, at least ``low_min``."""
    low = max(math.floor(length * (1.0 - ratio)), low_min)
    high = max(math.ceil(length * (1.0 + ratio)), low)
    return [int(x) for x in rng.integers(low, high + 1, size=size)]


def build_dataset(config: DatasetConfig, source: TextSource) -> list[SampleRequest]:
    """The requests of one run, in send order."""
    config.validate()
    rng = np.random.default_rng(config.seed)
    if config.name == "jsonl":
        return load_jsonl(Path(str(config.path)), config.num_prompts, config.output_len, source)
    n = config.num_prompts or 1000
    input_len = DEFAULT_INPUT_LEN[config.name] if config.input_len is None else config.input_len
    prefix_len = DEFAULT_PREFIX_LEN[config.name] if config.prefix_len is None else config.prefix_len
    input_lens = spread(input_len, config.range_ratio, n, rng, low_min=0 if prefix_len else 1)
    output_lens = spread(config.output_len, config.range_ratio, n, rng, low_min=1)
    if config.name == "random":
        return _random(source, rng, input_lens, output_lens, prefix_len)
    if config.name == "shared-prefix":
        return _shared_prefix(source, rng, input_lens, output_lens, prefix_len, config.num_prefixes)
    return _long_doc(source, rng, input_lens, output_lens, config.num_docs)


def _random(
    source: TextSource,
    rng: np.random.Generator,
    input_lens: list[int],
    output_lens: list[int],
    prefix_len: int,
) -> list[SampleRequest]:
    prefix, _ = source.text(prefix_len, rng)
    out = []
    for in_len, out_len in zip(input_lens, output_lens, strict=True):
        body, _ = source.text(in_len, rng)
        prompt = f"{prefix} {body}" if prefix and body else prefix or body
        out.append(SampleRequest(prompt, source.count(prompt), out_len))
    return out


def _shared_prefix(
    source: TextSource,
    rng: np.random.Generator,
    input_lens: list[int],
    output_lens: list[int],
    prefix_len: int,
    num_prefixes: int,
) -> list[SampleRequest]:
    systems = [source.text(prefix_len, rng)[0] for _ in range(num_prefixes)]
    out = []
    for i, (in_len, out_len) in enumerate(zip(input_lens, output_lens, strict=True)):
        system = systems[i % num_prefixes]
        question = f"Question {i}: {source.text(in_len, rng)[0]}?"
        prompt = f"{system}\n\n{question}"
        messages = (("system", system), ("user", question))
        out.append(SampleRequest(prompt, source.count(prompt), out_len, messages))
    return out


def _long_doc(
    source: TextSource,
    rng: np.random.Generator,
    input_lens: list[int],
    output_lens: list[int],
    num_docs: int | None,
) -> list[SampleRequest]:
    count = len(input_lens) if num_docs is None else min(num_docs, len(input_lens))
    docs = [source.text(input_lens[d], rng)[0] for d in range(count)]
    out = []
    for i, out_len in enumerate(output_lens):
        instruction = LONG_DOC_INSTRUCTIONS[i % len(LONG_DOC_INSTRUCTIONS)]
        prompt = f"{docs[i % count]}\n\n{instruction}"
        out.append(SampleRequest(prompt, source.count(prompt), out_len))
    return out


def load_jsonl(
    path: Path, num_prompts: int | None, default_output_len: int, source: TextSource
) -> list[SampleRequest]:
    """Requests from a JSONL file (format in the module docstring); errors name the line."""
    rows: list[SampleRequest] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                rows.append(_parse_jsonl_row(line, f"{path}:{lineno}", default_output_len, source))
    if not rows:
        raise ValueError(f"{path}: no prompts found")
    n = num_prompts or len(rows)
    return [rows[i % len(rows)] for i in range(n)]


def _parse_jsonl_row(
    line: str, where: str, default_output_len: int, source: TextSource
) -> SampleRequest:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
    if isinstance(row, str):
        row = {"prompt": row}
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected an object or a string")
    output_len = row.get("output_len", row.get("max_tokens", default_output_len))
    if not isinstance(output_len, int) or output_len < 1:
        raise ValueError(f"{where}: output_len must be an integer >= 1")
    if isinstance(row.get("messages"), list):
        try:
            messages = tuple((str(m["role"]), str(m["content"])) for m in row["messages"])
        except (KeyError, TypeError):
            raise ValueError(f"{where}: each message needs 'role' and 'content'") from None
        prompt = "\n\n".join(content for _, content in messages)
        return SampleRequest(prompt, source.count(prompt), output_len, messages)
    text = row.get("prompt")
    if not isinstance(text, str):
        raise ValueError(f"{where}: needs a string 'prompt' or a 'messages' list")
    return SampleRequest(text, source.count(text), output_len)
