"""Hydra config groups of the priority batching plugin (``batching/priority``)."""
