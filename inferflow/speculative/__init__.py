"""Deprecated package: only ``inferflow.speculative.proposer`` remains, a shim that imports
``scheduling/speculation.py`` (speculative decoding lives there and in ``stages/speculative.py``)."""
