"""``inferflow.bench.cli.main``: arguments, result files, exit codes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from inferflow.bench.cli import main
from inferflow.testing.fake_server import FakeServer

pytestmark = pytest.mark.server

Factory = Callable[..., FakeServer]


def bench(server: FakeServer, tmp_path: Path, *extra: str) -> dict:
    code = main(
        [
            "--base-url",
            server.url,
            "--num-prompts",
            "3",
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "out.json",
            *extra,
        ]
    )
    assert code == 0
    return json.loads((tmp_path / "out.json").read_text())


def test_result_file_has_vllm_keys_setup_and_metrics(
    fake_server: Factory, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft_s=0.01, token_delay_s=0.005)
    result = bench(
        server,
        tmp_path,
        "--label",
        "fake",
        "--max-concurrency",
        "2",
        "--metadata",
        "config=test",
        "--goodput",
        "ttft:5000",
        "tpot:5000",
    )
    assert result["model_id"] == "fake-model"  # discovered through /v1/models
    assert result["backend"] == result["endpoint_type"] == "openai"
    assert (result["label"], result["max_concurrency"], result["request_rate"]) == (
        "fake",
        2,
        "inf",
    )
    assert result["config"] == "test" and result["dataset_name"] == "random"
    assert (result["completed"], result["failed"], result["num_prompts"]) == (3, 0, 3)
    assert result["total_output_tokens"] == 12
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "std_ttft_ms"):
        assert result[key] > 0
    assert "ttfts" not in result  # per-request arrays only with --save-detailed
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    # The random dataset ignores EOS by default, as vLLM does.
    assert all(s.body["ignore_eos"] is True for s in server.received)


def test_detailed_output_joins_server_traces(fake_server: Factory, tmp_path: Path) -> None:
    server = fake_server(ttft_s=0.01, token_delay_s=0.005)
    result = bench(
        server,
        tmp_path,
        "--save-detailed",
        "--endpoint",
        "/v1/chat/completions",
        "--dataset-name",
        "shared-prefix",
        "--prefix-len",
        "10",
        "--no-ignore-eos",
        "--force-output-len",
    )
    assert result["backend"] == "openai-chat"
    traced = {s.headers["traceparent"].split("-")[1] for s in server.received}
    assert set(result["trace_ids"]) == traced
    assert result["request_ids"] == ["bench-0", "bench-1", "bench-2"]
    assert len(result["itls"]) == 3 and all(len(itl) == 3 for itl in result["itls"])
    body = server.received[0].body
    assert body["messages"][0]["role"] == "system" and body["min_tokens"] == 4
    assert "ignore_eos" not in body


def test_append_result_adds_lines(fake_server: Factory, tmp_path: Path) -> None:
    server = fake_server(ttft_s=0.005, token_delay_s=0.001)
    for _ in range(2):
        main(
            [
                "--base-url",
                server.url,
                "--num-prompts",
                "1",
                "--input-len",
                "2",
                "--output-len",
                "2",
                "--disable-tqdm",
                "--append-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "a.jsonl",
            ]
        )
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(line)["completed"] for line in lines] == [1, 1]


def test_all_failed_exits_1_and_bad_arguments_exit_2(fake_server: Factory, tmp_path: Path) -> None:
    server = fake_server(ttft_s=0.005, token_delay_s=0.001)
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "[[http-500]]"}) + "\n")
    base = ["--base-url", server.url, "--disable-tqdm"]
    assert main([*base, "--dataset-name", "jsonl", "--dataset-path", str(path)]) == 1
    assert main([*base, "--goodput", "itl:5"]) == 2
    assert main([*base, "--goodput", "ttft"]) == 2
    assert main([*base, "--range-ratio", "1.5"]) == 2
    assert main([*base, "--dataset-name", "nope"]) == 2  # argparse's own exit code
    assert main(["--base-url", "http://127.0.0.1:9", "--disable-tqdm"]) == 1  # no /v1/models


def test_main_works_inside_a_running_event_loop(fake_server: Factory) -> None:
    """A Jupyter cell runs inside an event loop; main() must still work there."""
    server = fake_server(ttft_s=0.005, token_delay_s=0.001)
    argv = [
        "--base-url",
        server.url,
        "--num-prompts",
        "2",
        "--input-len",
        "2",
        "--output-len",
        "2",
        "--disable-tqdm",
    ]

    async def cell() -> int:
        return main(argv)

    assert asyncio.run(cell()) == 0


def test_module_entry_point_runs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "inferflow.bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0 and "--max-concurrency" in proc.stdout
