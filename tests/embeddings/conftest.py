"""Fixtures for the embedding tests: MiniLM, a sentence-transformers oracle, tiny seeded BERTs.

sentence-transformers / torch / transformers are test-only oracles; nothing is downloaded
(HF_HUB_OFFLINE=1 and every model is loaded from a local folder).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from embedding_cases import SENTENCES, SETTINGS, write_tiny_bert

from inferflow.embeddings.encoder_runner import EncoderRunner
from inferflow.models.bert import minilm_path


@pytest.fixture(scope="session")
def engine_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compiled_engines")


@pytest.fixture(scope="session")
def minilm() -> Path:
    return minilm_path()


@pytest.fixture(scope="session")
def minilm_engine(minilm: Path, engine_cache: Path) -> EncoderRunner:
    return EncoderRunner.from_path(minilm, cache_dir=engine_cache, settings=SETTINGS)


@pytest.fixture(scope="session")
def st_oracle() -> Callable[[Path], Any]:
    """Loads a SentenceTransformer from a local folder (cached per folder)."""
    st = pytest.importorskip("sentence_transformers")
    import torch

    torch.set_num_threads(1)
    loaded: dict[Path, Any] = {}

    def load(path: Path) -> Any:
        if path not in loaded:
            loaded[path] = st.SentenceTransformer(str(path), device="cpu", local_files_only=True)
        return loaded[path]

    return load


@pytest.fixture(scope="session")
def minilm_reference(st_oracle: Callable[[Path], Any], minilm: Path) -> np.ndarray:
    """sentence-transformers embeddings of SENTENCES (batch_size=1: no padding in the oracle)."""
    return st_oracle(minilm).encode(SENTENCES, batch_size=1, convert_to_numpy=True)


@pytest.fixture(scope="session")
def make_bert(
    tmp_path_factory: pytest.TempPathFactory, minilm: Path
) -> Iterator[Callable[..., Path]]:
    """make_bert(name, pooling=("mean",), normalize=False, ...) -> folder of a tiny seeded BERT."""
    root = tmp_path_factory.mktemp("tiny_berts")
    yield lambda name, **kw: write_tiny_bert(root / name, minilm, **kw)
    shutil.rmtree(root, ignore_errors=True)
