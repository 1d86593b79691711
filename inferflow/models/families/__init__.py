"""The model families inferflow serves, one module each, and their registry.

Each module defines :class:`~inferflow.models.family.Family` values: how the family's
config.json maps onto the decoder the executors build (``models/family.py``). ``FAMILIES`` is the
one list ``config.json`` is matched against, ``/version`` and ``task=check`` name and the docs
table (docs/models.md) lists. To add a family: a module here, its entry below, a case in
``tests/engine/test_families.py``. It may import only ``models/family.py``.
"""

from __future__ import annotations

from inferflow.models.families import gemma, llama, moe, phi3, qwen3
from inferflow.models.family import Family

FAMILIES: dict[str, Family] = {
    f.architecture: f
    for module in (llama, qwen3, gemma, phi3, moe)
    for f in module.FAMILIES
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "Family"]
