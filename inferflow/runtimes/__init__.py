"""Compiled model runtimes ("runners"): what an executor stage runs the model on. Core layer:
imports ``models/``, ``scheduling/`` (the KV layout, the plan) and ``sampling/``; nothing of
``stages/`` or above (each executor stage picks its runner).

- ``onnxruntime_runner``: ONNX Runtime on CPU, slot KV buffers updated in place;
- ``tensorrt_runner``: TensorRT on an NVIDIA GPU (optional extra, imported lazily);
- ``plan_runner``: runs one scheduler plan on a runner (KV loads, forward, sampling, saves);
- ``engine_cache``: the compiled-engine cache (``compiled_engines/``, manifest, rebuild rules);
- ``step_inputs``: packing a step's rows into the runner's input arrays.
"""
