"""KV buffers are resident before the first step (``runtimes/kv_memory.py``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from inferflow.runtimes.kv_memory import kv_buffer

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def test_a_kv_buffer_is_zeroed_writable_and_resident() -> None:
    before = rss_bytes()
    buf = kv_buffer((8, 2, 4096, 64), np.dtype(np.float32))  # 16 MiB
    assert buf.flags.c_contiguous and buf.flags.writeable and buf.dtype == np.float32
    assert rss_bytes() - before >= 0.9 * buf.nbytes  # mapped in, not left to the first write
    assert not buf.any()
    buf[3, 1, 100] = 7.0
    assert buf[3, 1, 100, 5] == 7.0 and buf.sum() == 7.0 * 64


def test_without_madv_populate_write_the_zeros_are_written(monkeypatch: pytest.MonkeyPatch) -> None:
    from inferflow.runtimes import kv_memory

    monkeypatch.setattr(kv_memory, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice the kernel refuses
    before = rss_bytes()
    buf = kv_buffer((4, 2, 4096, 64), np.dtype(np.float32))  # 8 MiB
    assert rss_bytes() - before >= 0.9 * buf.nbytes
    assert not buf.any()
