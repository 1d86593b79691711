"""Experiments: measurements that can be trusted and compared (issue 42).

``task=offline`` (the engine alone) and ``task=bench`` (this config served over HTTP, driven by
the load generator) measure one point with a warm-up and ``experiment.repeats`` repeats
(:mod:`~inferflow.experiment.figures`: mean, spread, the machine's load); a Hydra multirun ends
with one table across its runs (:mod:`~inferflow.experiment.summary`, a Hydra callback);
``inferflow tune`` searches the composed config for the most goodput under SLOs
(:mod:`~inferflow.experiment.tune`).

A top-tier package beside ``bench/`` and ``testing/``: it may import anything; ``cli`` reaches it
through module names (``TASKS``), never an import.
"""
