"""Token sampling (pure numpy) of a scheduler plan's logits, the structured-output token bitmask,
rejection sampling of drafts, and stop-string handling. Core layer: imports ``sampling_params``
and ``scheduling/``'s plan.
"""
