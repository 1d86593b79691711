"""TensorRT path: pure parts run everywhere; the GPU build/run test skips without TensorRT."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
from engine_factories import make_named_checkpoint

from inferflow.models.checkpoint import load_checkpoint
from inferflow.runtimes import tensorrt_runner as trt_engine
from inferflow.runtimes.step_inputs import EngineRow, build_step_arrays


def test_module_imports_without_tensorrt() -> None:
    importlib.reload(trt_engine)  # no tensorrt / cuda import at module level
    if not trt_engine.tensorrt_available():
        with pytest.raises(RuntimeError, match=r"pip install 'inferflow\[tensorrt\]'"):
            trt_engine.import_tensorrt()


def test_profiles_cover_decode_and_prefill(tmp_path: Path) -> None:
    cfg = load_checkpoint(make_named_checkpoint(tmp_path, "gqa8x2")).config
    decode, prefill = trt_engine.optimization_profiles(cfg, max_slots=8, alloc_capacity=1024 + 256, max_chunk=256)
    assert decode.shapes["pad_index"][2] == (8, 1)
    assert prefill.shapes["pad_index"][2] == (8, 256)
    assert prefill.shapes["input_ids"][2] == (256 + 8,)
    assert decode.shapes["past_key_3"][2] == (8, cfg.num_kv_heads, 1280, cfg.head_dim)
    assert len([k for k in decode.shapes if k.startswith("past_")]) == 2 * cfg.num_layers


def test_idle_slots_write_past_their_valid_tokens() -> None:
    rows = [EngineRow(0, (1, 2, 3), 5, True), EngineRow(2, (4,), 9, True)]
    arrays = build_step_arrays(rows, slot_range=True)
    # slot 1 is idle with 7 valid tokens: its garbage goes to positions >= 7
    np.testing.assert_array_equal(trt_engine.idle_write_indices(arrays, [5, 7, 9, 0]), [5, 7, 9])
    assert trt_engine.profile_index(arrays) == 1
    assert trt_engine.profile_index(build_step_arrays([rows[1]], slot_range=True)) == 0


@pytest.mark.gpu
def test_tensorrt_engine_matches_onnxruntime(tmp_path: Path) -> None:
    pytest.importorskip("tensorrt")
    pytest.importorskip("cuda")
    from engine_factories import greedy, make_engine

    from inferflow.models.llama_graph import GraphSpec
    from inferflow.runtimes.engine_cache import get_or_build
    from inferflow.runtimes.llama_build import build_llama_engine

    path = make_named_checkpoint(tmp_path, "gqa8x2")
    ck = load_checkpoint(path)
    spec = GraphSpec("canonical", "fp32", 256 + 64)
    entry = get_or_build(tmp_path / "engines", {"k": "trt"}, lambda folder: build_llama_engine(ck, spec, folder))
    profiles = trt_engine.optimization_profiles(ck.config, 4, 256 + 64, 64)
    plan = trt_engine.build_serialized_engine(str(entry.model_path), profiles)
    runtime = trt_engine.TensorRTRuntime(plan, ck.config, 4, 256 + 64, np.dtype(np.float32))
    prompt = ck.tokenizer.encode("Hello, world!")
    assert greedy(runtime, prompt, 16)[0] == greedy(make_engine(path), prompt, 16)[0]  # type: ignore[arg-type]


def test_tensorrt_backend_without_tensorrt_is_one_clear_error(tmp_path: Path) -> None:
    if trt_engine.tensorrt_available():
        pytest.skip("TensorRT is installed here")
    from inferflow.scheduling.layout import KVLayout
    from inferflow.stages.executor import TensorRTExecutor

    ck = load_checkpoint(make_named_checkpoint(tmp_path, "gqa8x2"))
    with pytest.raises(RuntimeError, match=r"pip install 'inferflow\[tensorrt\]'"):
        TensorRTExecutor().create_runner(ck, KVLayout.plan(8, 1024))


def test_profiles_follow_the_schedulers_step_limits(tmp_path: Path) -> None:
    cfg = load_checkpoint(make_named_checkpoint(tmp_path, "gqa8x2")).config
    chunk, tokens = trt_engine.step_limits(capacity=4096, max_num_batched_tokens=512)
    assert (chunk, tokens) == (512, 512)  # no chunk or step beyond the token budget
    assert trt_engine.step_limits(capacity=256, max_num_batched_tokens=512) == (256, 512)
    assert trt_engine.step_limits(capacity=4096, max_num_batched_tokens=0) == (2048, 0)
    decode, prefill = trt_engine.optimization_profiles(cfg, 16, 4096 + chunk, chunk, tokens)
    assert prefill.shapes["input_ids"][2] == (512,) and prefill.shapes["pad_index"][2] == (16, 512)
    assert decode.shapes["input_ids"][2] == (16,)  # one token per slot: max_num_seqs rows
    for profile in (decode, prefill):  # a step that samples no row still fits (dummy index)
        assert profile.shapes["logits_index"][0] == (1,)


def test_a_step_that_samples_no_row_binds_one_dummy_logits_index() -> None:
    # a chunked prefill that does not finish its prompt: nothing is sampled this step
    arrays = build_step_arrays([EngineRow(0, (5, 6, 7, 8), 0, False)], slot_range=True)
    assert len(arrays.logits_index) == 0
    feeds = trt_engine.step_feeds(arrays, [0, 0])
    assert feeds["logits_index"].shape == (1,)
    sampled = build_step_arrays([EngineRow(0, (5, 6), 0, True)], slot_range=True)
    np.testing.assert_array_equal(
        trt_engine.step_feeds(sampled, [0])["logits_index"], sampled.logits_index
    )


class _RefusingContext:
    """An execution context whose set_input_shape refuses, as TensorRT's does (returns False)."""

    def set_input_shape(self, name: str, shape: tuple[int, ...]) -> bool:
        return False


def test_a_refused_input_shape_is_a_clear_error(tmp_path: Path) -> None:
    cfg = load_checkpoint(make_named_checkpoint(tmp_path, "gqa8x2")).config
    _, prefill = trt_engine.optimization_profiles(cfg, 4, 320, 64, 128)
    with pytest.raises(RuntimeError, match=r"refused shape \(600,\) for input 'input_ids'.*max \(128,\)"):
        trt_engine.set_shape(_RefusingContext(), "input_ids", (600,), prefill)
