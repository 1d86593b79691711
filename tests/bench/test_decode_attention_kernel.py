"""benchmarks/decode_attention_kernel.py: the one-read kernel it times computes attention."""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import pytest

# the compiler build() takes: $CXX, else g++
pytestmark = [
    pytest.mark.slow,  # compiles a C++ kernel: a benchmark experiment, not serving
    pytest.mark.skipif(
        not (os.environ.get("CXX") or shutil.which("g++")), reason="needs a C++ compiler"
    ),
]


@pytest.mark.parametrize("context", [1, 17, 64])
def test_the_kernel_matches_softmax_attention_in_numpy(tmp_path: Path, context: int) -> None:
    from benchmarks.decode_attention_kernel import Kernel, build

    shape = argparse.Namespace(rows=3, layers=1, q_heads=6, kv_heads=2, head_dim=16,
                               capacity=64, repeats=1)
    kernel = Kernel(build(tmp_path), shape)
    assert kernel.max_error(context) < 1e-5
