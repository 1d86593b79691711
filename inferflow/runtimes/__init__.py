"""Compiled model runtimes ("runners"): what an executor stage runs the model on. Core layer:
imports ``models/``, ``scheduling/`` (the KV layout, the plan) and ``sampling/``; nothing of
``stages/`` or above (each executor stage picks its runner).

- ``onnxruntime_paged``: ONNX Runtime on CPU over a paged KV pool (the default where the
  paged-attention op builds: ``ort_ops``, the op's source, headers, build and cache);
- ``onnxruntime_runner``: ONNX Runtime on CPU, slot KV buffers updated in place (and what every
  ONNX Runtime engine shares, ``OrtEngine``);
- ``tensorrt_runner``: TensorRT on an NVIDIA GPU (optional extra, imported lazily);
- ``plan_runner``: runs one scheduler plan on a runner (KV loads, forward, sampling, saves);
- ``engine_cache``: the compiled-engine cache (``compiled_engines/``, manifest, rebuild rules);
- ``step_inputs``: packing a step's rows into the runner's input arrays (slots; paged, shared
  with ``torch_engine``).
"""
