"""What ``models/graph_attention.py`` assumes of ONNX Runtime's GroupQueryAttention kernel, on
one GQA node against a numpy reference of transformers' attention: ``local_window_size = W`` is
the window p - W < j <= p, ``scale`` and ``softcap`` are transformers' (scores * scale, then
cap * tanh(s / cap)), and partial rotary through ``gqa_head_layout`` rotates the model's pairs;
whole prompts, chunks across the window and decode alike. (The families' end-to-end tests are
``test_families.py``; these fail fast where an ONNX Runtime upgrade changes a meaning.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from engine_factories import make_engine
from onnx import TensorProto, helper

from inferflow.models.errors import CheckpointError
from inferflow.models.graph_attention import gqa_head_layout
from inferflow.models.tiny import make_checkpoint
from inferflow.runtimes.step_inputs import EngineRow

HQ, HKV, CAPACITY, T = 4, 2, 64, 40


def rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, rotary_dim: int) -> np.ndarray:
    """transformers' rotate-half over the first ``rotary_dim`` dims of x (..., T, D); cos and
    sin (T, rotary_dim / 2)."""
    half = rotary_dim // 2
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def tables(rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    inv = 1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2) / rotary_dim)
    angles = np.outer(np.arange(CAPACITY), inv)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, rotary_dim: int, window: int | None,
              scale: float, softcap: float | None) -> np.ndarray:
    """q (HQ, T, D), k and v (HKV, T, D) -> attention output (T, HQ * D)."""
    cos, sin = tables(rotary_dim)
    q, k = rotate(q, cos[:T], sin[:T], rotary_dim), rotate(k, cos[:T], sin[:T], rotary_dim)
    k, v = np.repeat(k, HQ // HKV, 0), np.repeat(v, HQ // HKV, 0)
    scores = q @ k.transpose(0, 2, 1) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    key, query = np.arange(T)[None], np.arange(T)[:, None]
    visible = (key <= query) & ((key > query - window) if window else True)
    scores = np.where(visible, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v).transpose(1, 0, 2).reshape(T, -1)


def gqa_session(head_dim: int, width: int, **attrs: object) -> ort.InferenceSession:
    f, i32 = TensorProto.FLOAT, TensorProto.INT32
    v = helper.make_tensor_value_info
    inputs = ["qkv", "", "", "past_key", "past_value", "seqlens_k", "total", "cos", "sin",
              "", "", "", "", "", "", "", "query_seqlens"]
    node = helper.make_node("GroupQueryAttention", inputs, ["out", "present_key", "present_value"],
                            domain="com.microsoft", num_heads=HQ, kv_num_heads=HKV, do_rotary=1, **attrs)
    kv = ["B", HKV, CAPACITY, head_dim]
    graph = helper.make_graph(
        [node], "gqa",
        [v("qkv", f, ["B", "S", (HQ + 2 * HKV) * head_dim]), v("past_key", f, kv), v("past_value", f, kv),
         v("seqlens_k", i32, ["B"]), v("total", i32, []), v("cos", f, ["P", width]), v("sin", f, ["P", width]),
         v("query_seqlens", i32, ["B"])],
        [v("out", f, None), v("present_key", f, kv), v("present_value", f, kv)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)],
                              ir_version=10)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("chunks", [[T], [13, 13, 14], [20] + [1] * 20], ids=["prompt", "chunks", "decode"])
@pytest.mark.parametrize(("head_dim", "rotary_dim", "window", "scale", "softcap"), [
    (16, 16, 8, None, None),  # Mistral: a window
    (16, 16, 8, 0.3, 5.0),  # Gemma 2: scale and soft-cap on a windowed layer
    (16, 12, None, None, None),  # Phi-4-mini-like partial rotary, r/2 = 6: laid out
    (32, 16, 8, None, None),  # r/2 = 8: the kernel's own partial rotary
])
def test_gqa_kernel_computes_transformers_attention(
    head_dim: int, rotary_dim: int, window: int | None, scale: float | None, softcap: float | None,
    chunks: list[int]
) -> None:
    rng = np.random.default_rng(0)
    q = rng.standard_normal((HQ, T, head_dim)).astype(np.float32)
    k, v = (rng.standard_normal((HKV, T, head_dim)).astype(np.float32) for _ in range(2))
    want = reference(q, k, v, rotary_dim, window, scale or head_dim ** -0.5, softcap)

    width, layout = gqa_head_layout(head_dim, rotary_dim)
    cos, sin = tables(rotary_dim)
    pad = width - rotary_dim // 2
    cos = np.concatenate([cos, np.ones((CAPACITY, pad), np.float32)], axis=1)
    sin = np.concatenate([sin, np.zeros((CAPACITY, pad), np.float32)], axis=1)
    if layout is not None:  # the builder lays out the q and k projections' columns so
        q, k = q[..., layout], k[..., layout]
    packed = np.concatenate([x.transpose(1, 0, 2).reshape(T, -1) for x in (q, k, v)], axis=1)[None]
    attrs = {"local_window_size": window} if window else {}
    attrs |= {name: value for name, value in (("scale", scale), ("softcap", softcap)) if value}
    session = gqa_session(head_dim, width, **attrs)
    past_key = past_value = np.zeros((1, HKV, CAPACITY, head_dim), np.float32)
    got, start = [], 0
    for n in chunks:
        out, past_key, past_value = session.run(None, {
            "qkv": packed[:, start:start + n], "past_key": past_key, "past_value": past_value,
            "seqlens_k": np.array([start + n - 1], np.int32), "total": np.array(CAPACITY, np.int32),
            "query_seqlens": np.array([n], np.int32), "cos": cos, "sin": sin})
        got.append(out[0])
        start += n
    np.testing.assert_allclose(np.concatenate(got), want, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 12), (64, 40), (128, 96), (128, 100)])
def test_gqa_head_layout_puts_the_rotary_pairs_where_the_kernel_turns(head_dim: int, rotary_dim: int) -> None:
    """Rotating the laid-out head as the kernel does (pairs (n, n + w), the padding pairs by 0)
    is the layout of the model's rotated head."""
    width, layout = gqa_head_layout(head_dim, rotary_dim)
    assert width % 8 == 0 and rotary_dim // 2 <= width <= head_dim // 2
    if layout is None:
        assert width == rotary_dim // 2
        return
    assert sorted(layout) == list(range(head_dim))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, head_dim))
    angles = rng.standard_normal((5, rotary_dim // 2))
    turn = np.concatenate([angles, np.zeros((5, width - rotary_dim // 2))], axis=1)
    kernel = rotate(x[:, layout], np.cos(turn), np.sin(turn), 2 * width)
    np.testing.assert_allclose(kernel, rotate(x, np.cos(angles), np.sin(angles), rotary_dim)[:, layout])


def test_the_cpu_form_refuses_a_head_size_its_kernel_refuses(tmp_path: Path) -> None:
    """GroupQueryAttention's CPU kernel needs head sizes that are multiples of 16: refused in one
    line naming the field and the form that serves it, which does."""
    path = make_checkpoint(tmp_path / "d24", num_layers=1, hidden_size=96, num_heads=4, num_kv_heads=2,
                           vocab_size=512)
    with pytest.raises(CheckpointError, match=r"head_dim=24: .* executor.graph_form=canonical"):
        make_engine(path, max_slots=1, max_model_len=64, cache_dir=str(tmp_path))
    engine = make_engine(path, graph_form="canonical", max_slots=1, max_model_len=64, cache_dir=str(tmp_path))
    assert engine.forward([EngineRow(0, (1, 2, 3), 0, True)]).shape == (1, 512)
