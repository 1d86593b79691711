"""Checkpoints and what is read from them: ``config.json`` (``config``, ``config_fields``,
``rope``), the weights (``checkpoint``, ``safetensors_reader``), the tokenizer and chat templates,
the generation defaults, and the ONNX graphs the runners compile (``llama_graph``,
``bert_graph``). Core layer: it imports only ``config/``, ``paths``, ``json_types`` and
``sampling_params``; nothing of ``scheduling/`` or above.
"""
