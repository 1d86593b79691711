"""fp16 / int8 / int4 engines: top-1 agreement with fp32 on a fixed set, and weight memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_factories import make_engine

from inferflow.models.quantize import quantize_blocked
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.runtimes.step_inputs import EngineRow

# a wider model than the other tests: quantization error depends on the matmul widths
SPEC = TinySpec(hidden_size=256, intermediate_size=768, num_layers=2, num_heads=8, num_kv_heads=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("precisions") / "m", SPEC, seed=3)


def next_token_logits(engine, sequences: list[list[int]]) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Teacher-forced: logits at every position of every sequence (the fixed evaluation set)."""
    rows = []
    for seq in sequences:
        for p in range(1, len(seq) + 1):
            rows.append(engine.forward([EngineRow(0, tuple(seq[:p]), 0, True)])[0])
    return np.stack(rows)


def test_blocked_quantization_round_trips() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 24)).astype(np.float32)
    for bits, tol in ((8, 0.01), (4, 0.2)):
        q = quantize_blocked(w, bits, block_size=32)
        assert q.q.min() >= -(1 << (bits - 1)) and q.q.max() < (1 << (bits - 1))
        assert np.abs(q.dequantize() - w).max() <= tol * np.abs(w).max()
        blob = q.matmulnbits_b()
        assert blob.shape == (24, 2, 32 * bits // 8)


def test_precision_agreement_and_memory(ckpt: Path, record_property: pytest.RecordProperty) -> None:
    rng = np.random.default_rng(7)
    sequences = [rng.integers(5, SPEC.vocab_size, size=24).tolist() for _ in range(6)]
    reference = next_token_logits(make_engine(ckpt, max_model_len=64), sequences).argmax(-1)
    report = {}
    for precision in ("fp32", "fp16", "int8", "int4"):
        engine = make_engine(ckpt, precision=precision, max_model_len=64)
        top1 = next_token_logits(engine, sequences).argmax(-1)
        report[precision] = (float((top1 == reference).mean()), engine.weight_bytes)
    for precision, (agreement, nbytes) in report.items():
        record_property(f"{precision}_top1_agreement", agreement)
        record_property(f"{precision}_weight_bytes", nbytes)
        print(f"{precision}: top-1 agreement with fp32 {agreement:.1%}, weights {nbytes / 1e6:.2f} MB")
    assert report["fp32"][0] == 1.0
    assert report["fp16"][0] >= 0.95
    assert report["int8"][0] >= 0.90
    assert report["int4"][0] >= 0.60
    assert report["int4"][1] < report["int8"][1] < report["fp32"][1]
    assert report["fp16"][1] < report["fp32"][1]


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("level", [0, 4])
def test_quantized_canonical_form_matches_cpu_form(ckpt: Path, precision: str, level: int) -> None:
    seq = list(range(10, 30))
    gqa = make_engine(ckpt, precision=precision, max_model_len=64, quant_accuracy_level=level)
    canonical = make_engine(ckpt, precision=precision, graph_form="canonical", max_model_len=64,
                            quant_accuracy_level=level)
    a = gqa.forward([EngineRow(0, tuple(seq), 0, True)])
    b = canonical.forward([EngineRow(0, tuple(seq), 0, True)])
    np.testing.assert_allclose(a, b, atol=2e-3 if level == 0 else 0.25, rtol=0)
