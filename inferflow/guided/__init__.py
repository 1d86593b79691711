"""Structured output: the constraint a request carries and how its token bitmask is applied.

The grammar stage (``inferflow/stages/guided.py``) compiles constraints and fills bitmasks; the
sampler applies them (``bitmask.py``); ``constraint.py`` is what travels with a request. It
imports nothing of inferflow (``sampling_params`` and ``sampling/`` import it).
"""
