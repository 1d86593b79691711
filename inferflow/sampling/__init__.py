"""Token sampling (pure numpy) of a scheduler plan's logits, the structured-output token bitmask
and rejection sampling of drafts. Core layer: imports ``sampling_params`` and ``scheduling/``'s
plan.
"""
