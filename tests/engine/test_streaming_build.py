"""Engines are built by streaming the checkpoint tensor by tensor (``runtimes/llama_build.py``).

The streamed files are byte for byte what the in-memory graph gives when onnx saves it, and the
default (gqa) engines hold byte for byte the weights built before streaming (golden digests; the
rotary tables, numpy's float32 cos/sin, vary in their last bits with the CPU), so every output
they produce is unchanged; the build's memory follows the largest tensor and not
the model; a second start reuses the engine without re-reading its files. (The canonical form's
int8/int4 weights moved from ``int32_data`` inside model.onnx to raw bytes in the data file:
the same values, a different encoding.)
"""

from __future__ import annotations

import logging
import tracemalloc
from pathlib import Path

import numpy as np
import onnx
import pytest
from engine_factories import greedy, make_engine

from inferflow.models import digest_cache, safetensors_reader
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.digest_cache import VERIFY_ENV
from inferflow.models.llama_graph import GraphSpec, build_llama_graph
from inferflow.models.tiny import make_checkpoint
from inferflow.runtimes.build_progress import BuildProgress
from inferflow.runtimes.llama_build import build_llama_engine

SMALL = {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "num_kv_heads": 2}
# 10 layers of one 2 MiB fused gate|up tensor (fp32) each: ~37 MiB of fp32 weights in all
TALL = {"num_layers": 10, "hidden_size": 256, "intermediate_size": 1024, "num_heads": 8,
        "num_kv_heads": 2, "vocab_size": 1024}
MiB = 1 << 20


@pytest.mark.parametrize(
    ("checkpoint", "form", "precision"),
    [
        ({"dtype": "bfloat16"}, "gqa", "fp32"),
        ({"dtype": "bfloat16", "shards": 2}, "gqa", "int4"),
        ({"dtype": "float16", "tie_word_embeddings": True}, "gqa", "fp16"),
        ({"attention_bias": True, "architecture": "Qwen2ForCausalLM"}, "gqa", "int8"),
        ({"dtype": "bfloat16"}, "canonical", "int4"),
        ({"tie_word_embeddings": True}, "canonical", "fp16"),
    ],
)
def test_the_streamed_engine_is_byte_identical_to_the_in_memory_graph(
    tmp_path: Path, checkpoint: dict, form: str, precision: str
) -> None:
    ck = load_checkpoint(make_checkpoint(tmp_path / "m", **SMALL, **checkpoint))
    spec = GraphSpec(form, precision, 128)  # type: ignore[arg-type]
    whole, streamed = tmp_path / "whole", tmp_path / "streamed"
    whole.mkdir(), streamed.mkdir()
    with ck.open_weights(np.float16 if precision == "fp16" else np.float32) as weights:
        model = build_llama_graph(ck.config, weights, spec)  # every initializer in the proto
    onnx.save_model(model, whole / "model.onnx", save_as_external_data=True,
                    location="model.onnx.data", size_threshold=1024)
    skeleton = build_llama_engine(ck, spec, streamed)
    assert skeleton.ByteSize() < 64 * 1024  # the weights went to the data file as they came
    onnx.save_model(skeleton, streamed / "model.onnx")
    for name in ("model.onnx", "model.onnx.data"):
        assert (whole / name).read_bytes() == (streamed / name).read_bytes(), name


@pytest.mark.parametrize(("dtype", "precision"), [("bfloat16", "int4"), ("float32", "fp32"),
                                                  ("bfloat16", "fp16")])
def test_build_memory_follows_the_largest_tensor_not_the_model(
    tmp_path: Path, dtype: str, precision: str
) -> None:
    ck = load_checkpoint(make_checkpoint(tmp_path / "m", dtype=dtype, **TALL))
    cfg = ck.config
    fused = cfg.hidden_size * 2 * cfg.intermediate_size * 4  # gate|up in fp32: the largest
    whole = 4 * sum(int(np.prod(s)) for s in _shapes(ck))  # the model in fp32
    assert whole > 15 * fused
    (tmp_path / "e").mkdir()
    tracemalloc.start()
    try:
        build_llama_engine(ck, GraphSpec("gqa", precision, 256), tmp_path / "e")  # type: ignore[arg-type]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # sources + the fused tensor + one quantization temporary, never the model
    assert peak < 3.5 * fused, (peak / MiB, fused / MiB)
    assert peak < whole / 4


# builds in a fresh process: RSS growth from just before the build to its high-water mark
_MEASURE = """
import json, resource, sys
from pathlib import Path
import numpy as np
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.llama_graph import GraphSpec, build_llama_graph
from inferflow.runtimes.build_progress import peak_rss_bytes, reset_peak_rss
from inferflow.runtimes.llama_build import build_llama_engine
ck, spec, out = load_checkpoint(sys.argv[1]), GraphSpec("gqa", sys.argv[2], 256), Path(sys.argv[3])
before = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()
reset_peak_rss()
if sys.argv[4] == "streamed":
    build_llama_engine(ck, spec, out)
else:  # what builds did before: the whole model in memory, then saved by onnx
    with ck.open_weights() as weights:
        model = build_llama_graph(ck.config, weights, spec)
print(json.dumps({"growth": peak_rss_bytes() - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures RSS through /proc")
@pytest.mark.slow  # builds in subprocesses to measure their memory
def test_build_rss_grows_by_tensors_not_by_the_model(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    spec = {**TALL, "num_layers": 16, "hidden_size": 384, "intermediate_size": 1536}
    ck = load_checkpoint(make_checkpoint(tmp_path / "m", dtype="bfloat16", **spec))
    fused = 384 * 2 * 1536 * 4  # 4.5 MiB
    whole = 4 * sum(int(np.prod(s)) for s in _shapes(ck))  # ~130 MiB in fp32

    def growth(precision: str, how: str) -> float:
        out = tmp_path / f"{precision}-{how}"
        out.mkdir()
        run = subprocess.run([sys.executable, "-c", _MEASURE, str(ck.path), precision, str(out), how],
                             capture_output=True, text=True, timeout=300, check=True)
        return float(json.loads(run.stdout.splitlines()[-1])["growth"])

    for precision in ("int4", "fp32"):
        streamed = growth(precision, "streamed")
        assert streamed < min(8 * fused, whole / 4), (precision, streamed / MiB, whole / MiB)
    assert growth("int4", "in_memory") > whole / 2  # the measure sees a whole-model build


def _shapes(ck: object) -> list[tuple[int, ...]]:
    from inferflow.models.checkpoint import expected_shapes

    return list(expected_shapes(ck.config).values())  # type: ignore[attr-defined]


def test_a_bf16_engine_greedy_output_equals_the_fp32_checkpoints(tmp_path: Path) -> None:
    """The same weights stored as bf16 (read one tensor at a time) and as their exact fp32
    values give the same engine and the same tokens."""
    bf16 = make_checkpoint(tmp_path / "bf16", dtype="bfloat16", **SMALL)
    fp32 = tmp_path / "fp32"
    fp32.mkdir()
    with load_checkpoint(bf16).open_weights() as w:
        tensors = {n: w.read(n) for n in w.tensor_names}
    from inferflow.models.safetensors_writer import save_safetensors

    save_safetensors(tensors, fp32 / "model.safetensors")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (fp32 / f).write_bytes((bf16 / f).read_bytes())
    prompt = [5, 6, 7, 8]
    a = make_engine(bf16, cache_dir=str(tmp_path / "ea"))
    b = make_engine(fp32, cache_dir=str(tmp_path / "eb"))
    assert greedy(a, prompt, 12)[0] == greedy(b, prompt, 12)[0]
    data = "model.onnx.data"
    assert (a.cache_entry.path / data).read_bytes() == (b.cache_entry.path / data).read_bytes()


# sha256 of model.onnx.data built by the code before streaming (commit 7cc830f) for
# make_checkpoint(**SMALL, dtype="bfloat16"), gqa form, max_model_len 256, with the rotary tables
# zeroed: they are numpy's float32 cos/sin, whose last bits depend on the CPU's SIMD paths (an
# AVX-512 machine and an AVX2 one differ in ~15 % of the values), while every weight byte must not.
GOLDEN_DATA = {
    "fp32": "39f4d391be32d4dc00f186c36554db330de60cd28395f88fb78a00705bbe75cc",
    "int4": "6758da4fa107f258145665a2c9f95733556485f00a5e044da9f0eed8da788df7",
}
ROTARY_TABLES = ("cos_cache", "sin_cache")


def data_without_rotary_tables(engine_dir: Path) -> bytes:
    """model.onnx.data with the bytes of the cos/sin tables set to zero."""
    data = bytearray((engine_dir / "model.onnx.data").read_bytes())
    model = onnx.load(str(engine_dir / "model.onnx"), load_external_data=False)
    tables = [t for t in model.graph.initializer if t.name.startswith(ROTARY_TABLES)]
    assert len(tables) == 2
    for t in tables:
        ext = {e.key: e.value for e in t.external_data}
        offset, length = int(ext["offset"]), int(ext["length"])
        data[offset:offset + length] = bytes(length)
    return bytes(data)


@pytest.mark.parametrize("precision", sorted(GOLDEN_DATA))
def test_streamed_engines_are_the_engines_built_before(tmp_path: Path, precision: str) -> None:
    import hashlib

    ckpt = make_checkpoint(tmp_path / "m", dtype="bfloat16", **SMALL)
    engine = make_engine(ckpt, cache_dir=str(tmp_path / "e"), precision=precision)
    data = data_without_rotary_tables(engine.cache_entry.path)
    assert hashlib.sha256(data).hexdigest() == GOLDEN_DATA[precision]


def test_an_abandoned_build_is_removed_and_a_live_one_kept(tmp_path: Path) -> None:
    import os
    import shutil
    import subprocess

    ckpt = make_checkpoint(tmp_path / "m", **SMALL)
    engines = tmp_path / "engines"
    first = make_engine(ckpt, cache_dir=str(engines))
    key = first.cache_entry.key
    shutil.rmtree(first.cache_entry.path)  # the entry is gone: the next start builds it again
    dead = subprocess.Popen(["true"])  # a pid that has exited
    dead.wait()
    abandoned = engines / f".{key}-{dead.pid}-x"
    live = engines / f".{key}-{os.getpid()}-y"  # this process: a build still running
    for folder in (abandoned, live):
        folder.mkdir()
        (folder / "model.onnx.data").write_bytes(b"partial")
    make_engine(ckpt, cache_dir=str(engines))
    assert not abandoned.exists() and live.exists()


def test_a_second_start_finds_the_engine_without_rereading_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFERFLOW_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(VERIFY_ENV, raising=False)
    reads: list[str] = []

    def counting(path: Path, chunk: int = 1 << 22) -> str:
        reads.append(path.name)
        return safetensors_reader.file_digest(path, chunk)

    monkeypatch.setattr(digest_cache, "file_digest", counting)
    ckpt = make_checkpoint(tmp_path / "m", **SMALL)
    first = make_engine(ckpt, cache_dir=str(tmp_path / "engines"), precision="int4")
    assert "model.safetensors" in reads and first.cache_entry.manifest["build_peak_rss_bytes"] > 0
    reads.clear()
    second = make_engine(ckpt, cache_dir=str(tmp_path / "engines"), precision="int4")
    assert second.cache_entry.reused and reads == []  # weights and engine files: from the cache
    monkeypatch.setenv(VERIFY_ENV, "1")  # on demand: every file is hashed again
    make_engine(ckpt, cache_dir=str(tmp_path / "engines"), precision="int4")
    assert sorted(reads) == ["config.json", "model.onnx", "model.onnx.data", "model.safetensors"]


def test_the_build_logs_its_progress_and_peak_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import io
    import sys

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: log lines, not a bar
    monkeypatch.setattr(BuildProgress, "quiet_s", 0.0)  # as slow as a real model's build
    ck = load_checkpoint(make_checkpoint(tmp_path / "m", **SMALL))
    (tmp_path / "e").mkdir()
    with caplog.at_level(logging.INFO, logger="inferflow.runtimes.build_progress"):
        build_llama_engine(ck, GraphSpec("gqa", "int8", 128), tmp_path / "e")
    lines = [r.getMessage() for r in caplog.records]
    assert any("100% (21 of 21 tensors" in line for line in lines), lines  # 2 layers x 9 + embed, norm, lm_head
    assert 5 <= len(lines) <= 12 and "peak RSS" in lines[-1] and "21 tensors" in lines[-1]
