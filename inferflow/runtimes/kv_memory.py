"""KV buffers that are really reserved: mapped, checked against the machine's memory, and
faulted in by a background thread while the engine starts serving.

A zero-filled numpy array of this size is mapped lazily: each 4 KiB page (or 2 MiB huge page,
which numpy asks for) is faulted in and zeroed by the kernel the first time a step writes it. In
a serving engine that first write happens inside a step: a prefix-cache save to a block the
pool never used, a new slot's first prefill. Measured on a 2-vCPU VM: ~2.3 us per 4 KiB page
(128 fresh blocks of the 4.5M model: ~3.5 ms in one step) and up to 75 ms for one huge page
the kernel had to compact memory for. llama.cpp (it clears its KV buffer) and vLLM (torch.zeros)
pay this at start, before they serve; that took 0.1-7.5 s per GiB on that VM (the most when the
kernel first has to assemble huge pages), which every start of the default model (1 GiB of KV)
then waited for. So:

- the buffers are private anonymous mappings that ask for transparent huge pages, as numpy does
  for its large arrays (a decode step reads 64 slots' K/V ~10 % faster from them than from
  4 KiB pages here);
- ``check_fits`` refuses, at load, a KV reservation larger than the memory the machine has
  available, so an engine that cannot have its KV fails at start, not in a request;
- ``make_resident`` has a daemon thread call ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+)
  over the buffers, slot buffers first: every page mapped writable and zeroed within seconds
  of the start, while the engine already serves. The call goes through ctypes, which releases
  the GIL, and it only faults in pages that are not there yet, so a step that writes a page
  first is not disturbed (its data stays). Where the kernel lacks the advice, pages are faulted
  in by the steps, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.13


def kv_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed, C-contiguous array in its own anonymous private mapping (huge pages asked for;
    pages are faulted in by ``make_resident`` or by the first write)."""
    count = int(np.prod(shape))
    region = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks for its own large arrays
        region.madvise(mmap.MADV_HUGEPAGE)
    # the array keeps the mapping alive (buffer protocol); the mapping is unmapped with it
    return np.frombuffer(region, dtype=dtype, count=count).reshape(shape)


def available_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


def check_fits(nbytes: int) -> None:
    """Raise ``MemoryError`` when ``nbytes`` of KV exceed the memory available now."""
    available = available_bytes()
    if available is not None and nbytes > available:
        raise MemoryError(
            f"the KV buffers need {nbytes / 2**20:.0f} MiB and the machine has "
            f"{available / 2**20:.0f} MiB available: lower batching.max_num_seqs, "
            "executor.max_model_len or executor.num_blocks")


def _madvise() -> Callable[..., Any] | None:
    """libc's madvise through ctypes (a foreign call releases the GIL), or None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    func = ctypes.CDLL(name, use_errno=True).madvise
    func.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    func.restype = ctypes.c_int
    return func


def populate(buffers: Sequence[np.ndarray]) -> bool:
    """Fault in every page of ``buffers`` (``kv_buffer`` arrays), in order; False when the
    kernel (or the platform) lacks ``MADV_POPULATE_WRITE``."""
    madvise = _madvise()
    if madvise is None:
        return False
    for buf in buffers:
        if madvise(buf.ctypes.data, buf.nbytes, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err == errno.EINVAL:  # an older kernel: the steps fault the pages in
                return False
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) of {buf.nbytes} bytes failed")
    return True


def make_resident(buffers: Sequence[np.ndarray]) -> threading.Thread:
    """Start a daemon thread that populates ``buffers`` (``populate``) and logs how long it
    took; returned so a caller can wait for it."""
    total = sum(b.nbytes for b in buffers)

    def run() -> None:
        started = time.perf_counter()
        try:
            done = populate(buffers)
        except OSError as exc:
            log.error("KV buffers: %.0f MiB could not be made resident (%s); steps will fault "
                      "their pages in", total / 2**20, exc)
            return
        if done:
            log.info("KV buffers: %.0f MiB made resident in %.2f s (in the background)",
                     total / 2**20, time.perf_counter() - started)
        else:
            log.info("KV buffers: the kernel lacks MADV_POPULATE_WRITE; steps fault pages in")

    thread = threading.Thread(target=run, name="inferflow-kv-populate", daemon=True)
    thread.start()
    return thread
