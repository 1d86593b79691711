"""Load a Llama-family checkpoint in Hugging Face layout.

Folder: ``config.json``, ``model.safetensors`` or sharded ``model-*.safetensors`` +
``model.safetensors.index.json`` (fp32/fp16/bf16), ``tokenizer.json`` + ``tokenizer_config.json``.
Every failure is a :class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from inferflow.models.config import ModelArch, parse_model_config
from inferflow.models.digest_cache import cached_file_digest
from inferflow.models.errors import CheckpointError
from inferflow.models.safetensors_reader import SafetensorsFile, iter_shards
from inferflow.models.tokenizer import Tokenizer


@dataclass
class LayerWeights:
    """One decoder layer, as float32 arrays in (in_features, out_features) layout for MatMul."""

    input_norm: np.ndarray  # (H,)
    wq: np.ndarray  # (H, Hq*D)
    wk: np.ndarray  # (H, Hkv*D)
    wv: np.ndarray  # (H, Hkv*D)
    wo: np.ndarray  # (Hq*D, H)
    post_norm: np.ndarray  # (H,)
    w_gate: np.ndarray  # (H, I)
    w_up: np.ndarray  # (H, I)
    w_down: np.ndarray  # (I, H)
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None


@dataclass
class ModelWeights:
    embed: np.ndarray  # (V, H)
    layers: list[LayerWeights] = field(default_factory=list)
    final_norm: np.ndarray | None = None  # (H,)
    lm_head: np.ndarray | None = None  # (H, V); the transposed embedding when tied


class Checkpoint:
    """A checkpoint folder: its config, tokenizer and (lazily) weights."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path).expanduser().resolve()
        if not self.path.is_dir():
            raise CheckpointError(self.path, "checkpoint folder does not exist")
        self.config: ModelArch = parse_model_config(self.path / "config.json")
        self.shards = list(iter_shards(self.path))
        for shard in self.shards:
            if not shard.exists():
                raise CheckpointError(shard, "weights shard listed in the index is missing")

    @property
    def name(self) -> str:
        return self.path.name

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.path)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    @cached_property
    def weights_digest(self) -> str:
        """sha256 over config.json and every shard's bytes: the identity of these weights
        (each file's digest reused while the file is unchanged: ``digest_cache``)."""
        h = hashlib.sha256()
        for f in [self.path / "config.json", *self.shards]:
            h.update(f.name.encode())
            h.update(cached_file_digest(f).encode())
        return h.hexdigest()

    def _tensors(self) -> Iterator[tuple[str, SafetensorsFile]]:
        for shard in self.shards:
            st = SafetensorsFile(shard)
            for name in st.tensors:
                yield name, st

    def load_weights(self) -> ModelWeights:
        """All weights as float32, shapes checked against config.json."""
        where = {name: st for name, st in self._tensors()}
        return _assemble(self.config, where, self.path)


def _assemble(cfg: ModelArch, where: dict[str, SafetensorsFile], folder: Path) -> ModelWeights:
    h, d = cfg.hidden_size, cfg.head_dim

    def get(name: str, shape: tuple[int, ...], transpose: bool = False) -> np.ndarray:
        st = where.get(name)
        if st is None:
            raise CheckpointError(folder, f"tensor {name!r} is missing from the weights")
        arr = st.read(name)
        if arr.shape != shape:
            raise CheckpointError(st.path, f"tensor {name!r} has shape {arr.shape}, config.json implies {shape}")
        return np.ascontiguousarray(arr.T) if transpose else arr

    def maybe(name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return get(name, shape) if cfg.attention_bias else None

    weights = ModelWeights(embed=get("model.embed_tokens.weight", (cfg.vocab_size, h)))
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights.layers.append(LayerWeights(
            input_norm=get(p + "input_layernorm.weight", (h,)),
            wq=get(p + "self_attn.q_proj.weight", (cfg.num_heads * d, h), transpose=True),
            wk=get(p + "self_attn.k_proj.weight", (cfg.num_kv_heads * d, h), transpose=True),
            wv=get(p + "self_attn.v_proj.weight", (cfg.num_kv_heads * d, h), transpose=True),
            wo=get(p + "self_attn.o_proj.weight", (h, cfg.num_heads * d), transpose=True),
            post_norm=get(p + "post_attention_layernorm.weight", (h,)),
            w_gate=get(p + "mlp.gate_proj.weight", (cfg.intermediate_size, h), transpose=True),
            w_up=get(p + "mlp.up_proj.weight", (cfg.intermediate_size, h), transpose=True),
            w_down=get(p + "mlp.down_proj.weight", (h, cfg.intermediate_size), transpose=True),
            bq=maybe(p + "self_attn.q_proj.bias", (cfg.num_heads * d,)),
            bk=maybe(p + "self_attn.k_proj.bias", (cfg.num_kv_heads * d,)),
            bv=maybe(p + "self_attn.v_proj.bias", (cfg.num_kv_heads * d,)),
        ))
    weights.final_norm = get("model.norm.weight", (h,))
    if cfg.tie_word_embeddings:
        weights.lm_head = np.ascontiguousarray(weights.embed.T)
    else:
        weights.lm_head = get("lm_head.weight", (cfg.vocab_size, h), transpose=True)
    return weights


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Open a checkpoint folder (config and file layout are checked now; weights load lazily)."""
    return Checkpoint(path)
