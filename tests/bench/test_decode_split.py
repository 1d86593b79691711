"""benchmarks/decode_split.py: the split decode step (segments and the C++ kernel between them)
gives the engine call's logits and KV, so the route it times computes the same thing."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.runtimes.config import OrtSettings
from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner
from inferflow.runtimes.step_inputs import EngineRow
from inferflow.scheduling.layout import KVLayout

pytestmark = [
    pytest.mark.slow,  # compiles a C++ kernel: a benchmark experiment, not serving
    pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++")),
                       reason="the kernel needs a C++ compiler"),
]

SLOTS = 24


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    from benchmarks.decode_attention_kernel import build

    return build(tmp_path_factory.mktemp("kernel"))


@pytest.fixture(scope="module", params=[32, 64], ids=["head_dim32", "head_dim64"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """head_dim 64 takes the kernel's AVX-512 path where the CPU has it, 32 the portable one."""
    spec = TinySpec(hidden_size=request.param * 4, num_heads=4, num_kv_heads=2, head_dim=request.param)
    return make_checkpoint(tmp_path_factory.mktemp("split") / "m", spec, seed=3)


def history(vocab: int) -> tuple[list[EngineRow], list[EngineRow]]:
    """Prefills of uneven lengths in scattered slots, and one decode token for each."""
    rng = np.random.default_rng(0)
    slots = rng.permutation(SLOTS)[:18]
    lengths = rng.integers(1, 120, size=len(slots))
    prefills = [EngineRow(int(s), tuple(int(t) for t in rng.integers(vocab, size=int(n))), 0, False)
                for s, n in zip(slots, lengths, strict=True)]
    decodes = [EngineRow(int(s), (int(rng.integers(vocab)),), int(n), True)
               for s, n in zip(slots, lengths, strict=True)]
    return prefills, decodes


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_a_split_step_gives_the_engine_calls_logits_and_kv(checkpoint: Path, library: ctypes.CDLL,
                                                           precision: str) -> None:
    """int8: the segments quantize the weights as the engine's graph does (MatMulNBits). Its
    accuracy level 4 also quantizes the activations, so an input that differs in the sixth digit
    can move a logit by ~0.1 (a wrong attention moves them by whole units)."""
    from benchmarks.decode_split import SplitDecoder

    settings, layout = OrtSettings(precision=precision), KVLayout.plan(SLOTS, 256)
    reference, engine = (OnnxRuntimeRunner(load_checkpoint(checkpoint), settings, layout)
                         for _ in range(2))
    split = SplitDecoder(load_checkpoint(checkpoint), engine.spec, engine.session_options(), engine.kv,
                         library)
    # int8: K/V come out of quantized projections too (0.04 seen on an AMX machine, where MLAS's
    # int8 kernels group the activations differently from a segment's smaller call)
    atol, kv_atol = (2e-4, 1e-5) if precision == "fp32" else (0.25, 0.1)
    prefills, decodes = history(reference.model_config.vocab_size)
    for runner in (reference, engine):
        runner.forward(prefills)
    want = reference.forward(decodes)
    got = split.forward(decodes)
    assert got.shape == want.shape == (len(decodes), reference.model_config.vocab_size)
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)
    for (k0, v0), (k1, v1) in zip(reference.kv, engine.kv, strict=True):
        for r in decodes:  # the new token's K and V, written where the engine call writes them
            np.testing.assert_allclose(k1[r.slot, :, r.start_pos], k0[r.slot, :, r.start_pos], atol=kv_atol)
            np.testing.assert_allclose(v1[r.slot, :, r.start_pos], v0[r.slot, :, r.start_pos], atol=kv_atol)
    # the engine's next call reads what the split step wrote
    following = [EngineRow(r.slot, (int(want[i].argmax()),), r.start_pos + 1, True) for i, r in enumerate(decodes)]
    np.testing.assert_allclose(engine.forward(following), reference.forward(following), atol=atol, rtol=0)
