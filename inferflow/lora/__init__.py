"""Multi-LoRA: many fine-tunes of one base model served together (issue 43).

- ``adapter.py``: a PEFT adapter folder -> :class:`LoraAdapter` (weights in the engine's
  ``x @ A @ B`` orientation, its scaling), checked against the engine's :class:`LoraSpec`;
- ``registry.py``: the adapters a server knows (name -> folder) and the host-memory LRU of the
  loaded ones (``max_cpu_loras``);
- ``slots.py``: which adapter sits in which of the engine's ``max_loras`` slots (LRU among the
  slots no running request uses); writes an adapter into a free slot without stopping the engine.

The engine forms (``models/llama_graph.py`` ONNX, ``runtimes/torch_engine``) add to every target
projection ``y += ((x @ A_all) * mask) @ B_all``: ``A_all`` (d_in, S*R) and ``B_all`` (S*R, d_out)
stack the ``S = max_loras`` slots, each padded to ``R = max_lora_rank`` (zero padding is exact);
``mask`` (N, S*R) holds, for each packed token, its adapter's scaling on that slot's R columns
and 0 elsewhere (a base-model token: all 0). So one step mixes adapters and the base model, for
prefill chunks and decode rows alike.

Imports: ``models`` (the base model's architecture, checkpoint errors) and numpy/safetensors; the
runtimes, stages, engine and graph import this package, never the other way round.
"""

from inferflow.lora.adapter import LORA_TARGETS, LoraAdapter, LoraError, LoraSpec, load_peft_adapter

__all__ = ["LORA_TARGETS", "LoraAdapter", "LoraError", "LoraSpec", "load_peft_adapter"]
