"""Deprecated package: only ``inferflow.guided.constraint`` remains, a shim that imports
``sampling_params.py`` (the constraint lives there, the token bitmask in ``sampling/bitmask.py``)."""
