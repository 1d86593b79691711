"""Token sampling (pure numpy) of a scheduler plan's logits, rejection sampling of drafts, and
stop-string handling. Core layer: imports ``sampling_params``, ``guided/``'s bitmask and
``scheduling/``'s plan.
"""
