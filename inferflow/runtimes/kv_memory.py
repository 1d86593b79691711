"""KV buffers that are really reserved: mapped, then faulted in before the engine's first step.

A zero-filled numpy array of this size is mapped lazily: each 4 KiB page (or 2 MiB huge page,
which numpy asks for) is faulted in and zeroed by the kernel the first time a step writes it. In
a serving engine that first write happens inside a step: a prefix-cache save to a block the
pool never used, a new slot's first prefill. Measured on a 2-vCPU VM: ~2.3 us per 4 KiB page
(128 fresh blocks of the 4.5M model: ~3.5 ms in one step) and up to 75 ms for one huge page
the kernel had to compact memory for. llama.cpp (it clears its KV buffer) and vLLM (torch.zeros)
pay this once, at start; so does inferflow now (0.1-2.9 s per GiB on that VM: the most when the
kernel first has to assemble huge pages, ~0.1 s after):

- the buffers are private anonymous mappings that ask for transparent huge pages, as numpy does
  for its large arrays (a decode step reads 64 slots' K/V ~10 % faster from them than from
  4 KiB pages here);
- ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14+) maps every page writable and zeroed before the
  engine reports ready; where the kernel lacks it, the buffers are written with zeros instead.

The memory the KV budget reserves (``scheduling/kv_budget.py``) is then resident from the start:
an engine that cannot have it fails at load, not in the middle of a request.
"""

from __future__ import annotations

import mmap

import numpy as np

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it only from 3.13


def kv_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zeroed, C-contiguous array in its own anonymous private mapping, every page resident."""
    count = int(np.prod(shape))
    region = mmap.mmap(-1, max(count * np.dtype(dtype).itemsize, 1),
                       flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # as numpy asks for its own large arrays
        region.madvise(mmap.MADV_HUGEPAGE)
    # the array keeps the mapping alive (buffer protocol); the mapping is unmapped with it
    buf = np.frombuffer(region, dtype=dtype, count=count).reshape(shape)
    try:
        region.madvise(MADV_POPULATE_WRITE)
    except OSError:  # a kernel without MADV_POPULATE_WRITE: write the zeros
        buf.fill(0)
    return buf
