"""KV buffers: checked against the machine's memory at load, made resident by a background
thread without disturbing what steps already wrote (``runtimes/kv_memory.py``)."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from inferflow.runtimes import kv_memory
from inferflow.runtimes.kv_memory import check_fits, kv_buffer, make_resident, populate

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status")


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kib * 1024


def test_a_kv_buffer_is_zeroed_writable_and_mapped_lazily() -> None:
    before = rss_bytes()
    buf = kv_buffer((8, 2, 4096, 64), np.dtype(np.float32))  # 16 MiB
    assert buf.flags.c_contiguous and buf.flags.writeable and buf.dtype == np.float32
    assert rss_bytes() - before < 0.5 * buf.nbytes  # nothing faulted in yet
    assert not buf.any()
    buf[3, 1, 100] = 7.0
    assert buf[3, 1, 100, 5] == 7.0 and buf.sum() == 7.0 * 64


def test_the_background_thread_makes_it_resident_and_keeps_what_was_written() -> None:
    bufs = [kv_buffer((8, 2, 4096, 64), np.dtype(np.float32)) for _ in range(2)]  # 2 x 16 MiB
    bufs[1][5, 0, 7] = 3.0  # a step wrote this page before the thread got to it
    before = rss_bytes()
    thread = make_resident(bufs)
    thread.join(30)
    assert not thread.is_alive()
    assert rss_bytes() - before >= 0.9 * sum(b.nbytes for b in bufs) - bufs[1][5].nbytes
    assert bufs[1][5, 0, 7, 0] == 3.0 and bufs[1].sum() == 3.0 * 64 and not bufs[0].any()


def test_a_kernel_without_the_advice_leaves_the_pages_to_the_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kv_memory, "MADV_POPULATE_WRITE", 0x7FFF)  # an advice the kernel refuses
    buf = kv_buffer((4, 2, 4096, 64), np.dtype(np.float32))
    assert populate([buf]) is False
    buf[0, 0, 0] = 1.0
    assert buf.sum() == 64.0


def test_a_reservation_larger_than_the_machine_fails_at_load() -> None:
    available = kv_memory.available_bytes()
    assert available is not None and available > 0
    check_fits(available // 2)
    with pytest.raises(MemoryError, match=r"the KV buffers need \d+ MiB"):
        check_fits(available * 2)
