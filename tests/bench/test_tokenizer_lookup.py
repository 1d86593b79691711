"""Which tokenizer ``inferflow bench`` counts with when ``--tokenizer`` is not given.

Order: ``--tokenizer``; ``--model`` as a local folder; the checkpoint folder named by the
server's ``GET /version``, looked up in this machine's model folders; else words, with a warning.
The simulated server answers ``/version`` as inferflow's does when given a ``checkpoint``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from inferflow.bench.cli import main
from inferflow.bench.text import TokenizerTextSource
from inferflow.bench.tokenizer_lookup import choose_token_counting
from inferflow.models.tiny import TRAINED
from inferflow.testing.fake_server import FakeServer

Factory = Callable[..., FakeServer]
UNREACHABLE = "http://127.0.0.1:9"  # nothing listens: a lookup that asks the server fails


def checkpoint(folder: Path) -> Path:
    """A checkpoint folder holding the tiny model's real tokenizer."""
    folder.mkdir(parents=True)
    shutil.copyfile(TRAINED / "tokenizer.json", folder / "tokenizer.json")
    return folder


def choose(server_url: str, tokenizer: str | None = None, model: str | None = None):
    return choose_token_counting(tokenizer, model, server_url, "fake-model", {})


@pytest.fixture
def models_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty ``$INFERFLOW_MODELS_DIR``, ``$INFERFLOW_HOME`` and Hugging Face cache."""
    monkeypatch.setenv("INFERFLOW_MODELS_DIR", str(tmp_path / "models"))
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "models"


def test_an_explicit_tokenizer_or_a_local_model_folder_needs_no_server(tmp_path: Path) -> None:
    given = choose(UNREACHABLE, tokenizer="some/tokenizer.json")
    assert (given.tokenizer, given.label, given.warning) == (
        "some/tokenizer.json",
        "tokenizer:some/tokenizer.json",
        "",
    )
    folder = checkpoint(tmp_path / "Llama-local")
    local = choose(UNREACHABLE, model=str(folder))
    assert (local.tokenizer, local.name) == (str(folder), str(folder))


def test_the_served_checkpoint_is_found_in_the_models_folder(
    fake_server: Factory, models_dir: Path
) -> None:
    folder = checkpoint(models_dir / "tiny-ckpt")
    counting = choose(fake_server(checkpoint="tiny-ckpt").url, model="fake-model")
    assert (counting.tokenizer, counting.label) == (str(folder), "tokenizer:tiny-ckpt")
    assert counting.name == "tiny-ckpt"  # the result names the folder, not where it lives


def test_inferflow_home_and_the_hugging_face_cache_are_searched(
    fake_server: Factory, models_dir: Path, tmp_path: Path
) -> None:
    home = checkpoint(tmp_path / "home" / "models" / "tiny_llama-v9")
    assert choose(fake_server(checkpoint="tiny_llama-v9").url).tokenizer == str(home)
    snapshot = checkpoint(tmp_path / "hub" / "models--org--m" / "snapshots" / "0123abcd")
    assert choose(fake_server(checkpoint="0123abcd").url).tokenizer == str(snapshot)


@pytest.mark.parametrize(
    ("checkpoint_name", "why"),
    [
        (None, "does not name its checkpoint"),  # vLLM's /version
        ("elsewhere", "'elsewhere' is in none of this machine's model folders"),
        ("../models/tiny-ckpt", "does not name its checkpoint"),  # a path is never followed
    ],
)
def test_otherwise_words_with_a_warning(
    fake_server: Factory, models_dir: Path, checkpoint_name: str | None, why: str
) -> None:
    checkpoint(models_dir / "tiny-ckpt")
    counting = choose(fake_server(checkpoint=checkpoint_name).url)
    assert (counting.tokenizer, counting.label) == (None, "words")
    assert why in counting.warning and "--tokenizer" in counting.warning


def test_the_result_says_how_tokens_were_counted(
    fake_server: Factory, models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = checkpoint(models_dir / "tiny-ckpt")
    args = ["--num-prompts", "3", "--input-len", "20", "--output-len", "2", "--disable-tqdm"]
    save = ["--save-result", "--save-detailed", "--result-dir", str(tmp_path)]
    counted = fake_server(checkpoint="tiny-ckpt")
    assert main(["--base-url", counted.url, *args, *save, "--result-filename", "t.json"]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    assert (result["token_counting"], result["tokenizer_id"]) == (
        "tokenizer:tiny-ckpt",
        "tiny-ckpt",
    )
    tokenizer = TokenizerTextSource(folder)
    assert [tokenizer.count(s.body["prompt"]) for s in counted.received] == [20, 20, 20]
    assert "no tokenizer" not in capsys.readouterr().err

    words = fake_server()  # no checkpoint named: one word, one token
    assert main(["--base-url", words.url, *args, *save, "--result-filename", "w.json"]) == 0
    result = json.loads((tmp_path / "w.json").read_text())
    assert (result["token_counting"], result["tokenizer_id"]) == ("words", None)
    assert result["input_lens"] == [20, 20, 20]  # the simulated server counts words
    assert "no tokenizer for fake-model" in capsys.readouterr().err
