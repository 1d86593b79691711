"""``inferflow bench`` as the docs run it: against the default server, without ``--tokenizer``.

The bench finds the served checkpoint's tokenizer through ``GET /version`` (the folder's name)
and this machine's model folders (the embedded model lives in ``$INFERFLOW_HOME/models``, which
the server and this process share), so ``--input-len`` is what the server counts: each request's
``usage.prompt_tokens`` (the detailed result's ``input_lens``) is ``--input-len``, plus the BOS
token the server's template may add.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_harness import ServerProcess

from inferflow.bench.cli import main

pytestmark = [pytest.mark.server, pytest.mark.slow]

INPUT_LEN = 48


def test_prompts_are_input_len_server_tokens_without_a_tokenizer_flag(
    default_server: ServerProcess, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--base-url", default_server.base_url, "--num-prompts", "4"]
    args += ["--input-len", str(INPUT_LEN), "--output-len", "2", "--disable-tqdm"]
    args += ["--save-result", "--save-detailed", "--result-dir", str(tmp_path)]
    assert main([*args, "--result-filename", "run.json"]) == 0
    result = json.loads((tmp_path / "run.json").read_text())
    model_folder = default_server.get("/version").json()["model"]["path"]
    assert result["token_counting"] == f"tokenizer:{model_folder}"
    assert result["output_tokens_sources"] == ["usage"] * 4  # input_lens: the server's counts
    assert all(abs(n - INPUT_LEN) <= 1 for n in result["input_lens"]), result["input_lens"]
    assert "no tokenizer" not in capsys.readouterr().err
