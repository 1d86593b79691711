"""Random PEFT LoRA adapters for a tiny seeded checkpoint, and transformers + peft references.

``make_peft_adapter`` builds an adapter with peft itself (``get_peft_model`` +
``save_pretrained``: the real PEFT format, safetensors) and fills every ``lora_A`` / ``lora_B``
with seeded random values (peft initialises ``lora_B`` to zero, which would leave the output
unchanged), sized so that an adapter changes greedy output noticeably while it stays sane.
``peft_reference`` (``PeftModel``) and ``merged_reference`` (``merge_and_unload``) are the
oracles of the multi-LoRA tests: greedy token ids, computed in float32 on CPU.

Needs torch, transformers and peft (the ``dev`` extra); nothing in the product imports this.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from inferflow.lora.adapter import LORA_TARGETS, projection_dims
from inferflow.models.safetensors_writer import save_safetensors

if TYPE_CHECKING:
    from inferflow.models.config import ModelArch

__all__ = ["base_reference", "make_peft_adapter", "merged_reference", "peft_reference",
           "write_lora_adapter"]


def _base_model(base_dir: Path) -> Any:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    return model


def make_peft_adapter(base_dir: Path, out_dir: Path, *, rank: int = 8, alpha: float = 16,
                      targets: Sequence[str] = LORA_TARGETS, seed: int = 0, rslora: bool = False,
                      strength: float = 0.1, dtype: str = "float32",
                      **lora_config: Any) -> Path:
    """Write a random LoRA adapter of the checkpoint ``base_dir`` to ``out_dir`` (PEFT format:
    ``adapter_config.json`` + ``adapter_model.safetensors``) and return ``out_dir``.

    Each trained projection ``W`` (d_out, d_in) gets ``lora_A`` (r, d_in) ~ N(0, 1/d_in) (so
    ``x @ A.T`` has unit-size entries for a normed ``x``) and ``lora_B`` (d_out, r) ~
    N(0, (strength / scaling)^2 / r): the update ``scaling * B @ A @ x`` is about ``strength``
    per entry against the tiny model's O(1) projections, whatever ``rank``, ``alpha`` and
    ``rslora`` (an engine that scales wrongly still diverges). Same arguments -> same values.
    ``dtype`` (float32, float16, bfloat16) is the stored tensors' type; ``lora_config``: further
    ``peft.LoraConfig`` fields (``use_dora``, ``bias``, ``modules_to_save``, ...), for adapters
    the server must refuse.
    """
    import torch
    from peft import LoraConfig, get_peft_model

    model = _base_model(Path(base_dir))
    fields: dict[str, Any] = {"r": rank, "lora_alpha": alpha, "target_modules": list(targets),
                              "lora_dropout": 0.0, "use_rslora": rslora, "task_type": "CAUSAL_LM"}
    config = LoraConfig(**{**fields, **lora_config})  # lora_alpha: a float works (typed int)
    peft_model = get_peft_model(model, config)
    scaling = alpha / (np.sqrt(rank) if rslora else rank)
    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters()):
            if ".lora_A." in name:
                std = 1.0 / np.sqrt(param.shape[1])
            elif ".lora_B." in name:
                std = strength / scaling / np.sqrt(param.shape[1])
            else:
                continue
            values = rng.standard_normal(tuple(param.shape)) * std
            param.copy_(torch.from_numpy(values.astype(np.float32)))
    if dtype != "float32":
        peft_model.to(getattr(torch, dtype))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(str(out), safe_serialization=True)
    return out


def write_lora_adapter(out_dir: Path, arch: ModelArch, *, rank: int = 8, alpha: float = 16,
                       targets: Sequence[str] = LORA_TARGETS, seed: int = 0,
                       layers: Sequence[int] | None = None, strength: float = 0.1) -> Path:
    """A random adapter in PEFT's layout for ``arch`` written with numpy alone (no torch, in
    milliseconds): the same keys, shapes and config fields ``save_pretrained`` writes, values
    drawn as ``make_peft_adapter`` draws them (not the same numbers). For unit tests that need
    many adapters; oracle tests use ``make_peft_adapter``."""
    rng = np.random.default_rng(seed)
    scaling = alpha / rank
    tensors: dict[str, np.ndarray] = {}
    for layer in range(arch.num_layers) if layers is None else layers:
        for target in targets:
            d_in, d_out = projection_dims(arch, target)
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, d_in))
                                               / np.sqrt(d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((d_out, rank)) * strength
                                               / scaling / np.sqrt(rank)).astype(np.float32)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "bias": "none", "use_rslora": False,
              "use_dora": False, "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {},
              "layers_to_transform": list(layers) if layers is not None else None,
              "base_model_name_or_path": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    save_safetensors(tensors, out / "adapter_model.safetensors")
    return out


def _greedy(model: Any, prompts_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's ``max_new_tokens`` greedy ids (one prompt at a time: no padding; EOS does
    not stop generation, as in the engines' ``ignore_eos`` runs)."""
    import torch

    outs: list[list[int]] = []
    with torch.no_grad():
        for prompt in prompts_ids:
            ids = torch.tensor([list(prompt)])
            full = model.generate(ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
            outs.append(full[0, len(prompt):].tolist())
    return outs


def base_reference(base_dir: Path, prompts_ids: Sequence[Sequence[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """Greedy ids of the base model alone (transformers, float32, CPU), the same way."""
    return _greedy(_base_model(Path(base_dir)), prompts_ids, max_new_tokens)


def peft_reference(base_dir: Path, adapter_dir: Path, prompts_ids: Sequence[Sequence[int]],
                   max_new_tokens: int) -> list[list[int]]:
    """Greedy ids of ``base_dir`` + the adapter through ``peft.PeftModel`` (float32, CPU)."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(_base_model(Path(base_dir)), Path(adapter_dir))
    model.eval()
    return _greedy(model, prompts_ids, max_new_tokens)


def merged_reference(base_dir: Path, adapter_dir: Path, prompts_ids: Sequence[Sequence[int]],
                     max_new_tokens: int) -> list[list[int]]:
    """Greedy ids of the base model with the adapter merged into its weights
    (``merge_and_unload``): the same function as ``peft_reference``, by another route."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(_base_model(Path(base_dir)), Path(adapter_dir))
    merged = model.merge_and_unload()
    merged.eval()
    return _greedy(merged, prompts_ids, max_new_tokens)
