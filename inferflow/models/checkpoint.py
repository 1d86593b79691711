"""Load a Llama-family checkpoint in Hugging Face layout.

Folder: ``config.json``, ``model.safetensors`` or sharded ``model-*.safetensors`` +
``model.safetensors.index.json`` (fp32/fp16/bf16), ``tokenizer.json`` + ``tokenizer_config.json``.
Every failure is a :class:`CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import numpy as np

from inferflow.models.config import ModelArch, parse_model_config
from inferflow.models.digest_cache import cached_file_digest
from inferflow.models.errors import CheckpointError
from inferflow.models.generation_config import (
    GenerationDefaults,
    load_generation_defaults,
    warn_not_applied,
)
from inferflow.models.safetensors_reader import SafetensorsFile, iter_shards
from inferflow.models.tokenizer import Tokenizer


class _Weight:
    """A layer tensor read from the checkpoint on each access (nothing is kept: the caller holds
    it); projections come transposed to (in_features, out_features) for MatMul. Where the family
    stores it fused with others (``Block.fused_qkv``/``fused_gate_up``), it is the rows of the
    fused tensor that are this projection's (``LayerWeights.fused_rows``)."""

    def __init__(self, name: str, transpose: bool = True) -> None:
        self.name, self.transpose = name, transpose

    def __get__(self, layer: LayerWeights, owner: type | None = None) -> np.ndarray:
        fused = layer.fused_rows(self.name)
        if fused is not None:
            name, rows = fused
            return layer.weights.read(layer.prefix + name, self.transpose, rows)
        return layer.weights.read(layer.prefix + self.name, self.transpose)


class _Bias:
    """The bias, or None where config.json gives the projection none (``expected_shapes``
    decides which biases a checkpoint has; ``ModelWeights`` located exactly those)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, layer: LayerWeights, owner: type | None = None) -> np.ndarray | None:
        name = layer.prefix + self.name
        return layer.weights.read(name) if layer.weights.has(name) else None


class LayerWeights:
    """One decoder layer's weights; each attribute reads its tensor from the checkpoint."""

    input_norm = _Weight("input_layernorm.weight", transpose=False)  # (H,)
    wq = _Weight("self_attn.q_proj.weight")  # (H, Hq*D)
    wk = _Weight("self_attn.k_proj.weight")  # (H, Hkv*D)
    wv = _Weight("self_attn.v_proj.weight")  # (H, Hkv*D)
    wo = _Weight("self_attn.o_proj.weight")  # (Hq*D, H)
    # Llama: the MLP's input norm; with Block.sandwich_norms (Gemma): the attention output's
    post_norm = _Weight("post_attention_layernorm.weight", transpose=False)  # (H,)
    w_gate = _Weight("mlp.gate_proj.weight")  # (H, I)
    w_up = _Weight("mlp.up_proj.weight")  # (H, I)
    w_down = _Weight("mlp.down_proj.weight")  # (I, H)
    bq = _Bias("self_attn.q_proj.bias")  # (Hq*D,)
    bk = _Bias("self_attn.k_proj.bias")  # (Hkv*D,)
    bv = _Bias("self_attn.v_proj.bias")  # (Hkv*D,)
    bo = _Bias("self_attn.o_proj.bias")  # (H,)
    b_gate = _Bias("mlp.gate_proj.bias")  # (I,)
    b_up = _Bias("mlp.up_proj.bias")  # (I,)
    b_down = _Bias("mlp.down_proj.bias")  # (H,)
    q_norm = _Weight("self_attn.q_norm.weight", transpose=False)  # (D,) Block.qk_norm
    k_norm = _Weight("self_attn.k_norm.weight", transpose=False)  # (D,)
    pre_ffn_norm = _Weight("pre_feedforward_layernorm.weight", transpose=False)  # (H,) sandwich
    post_ffn_norm = _Weight("post_feedforward_layernorm.weight", transpose=False)  # (H,)

    def __init__(self, weights: ModelWeights, index: int) -> None:
        self.weights, self.prefix, self.index = weights, f"model.layers.{index}.", index

    def fused_rows(self, name: str) -> tuple[str, slice] | None:
        """(fused tensor, rows) holding projection ``name`` where the family fuses it."""
        cfg = self.weights.config
        q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
        if cfg.block.fused_qkv and name in _QKV:
            start = {"q": 0, "k": q, "v": q + kv}[name[len("self_attn.")]]
            return "self_attn.qkv_proj.weight", slice(start, start + (q if start == 0 else kv))
        if cfg.block.fused_gate_up and name in _GATE_UP:
            start = 0 if name == "mlp.gate_proj.weight" else inter
            return "mlp.gate_up_proj.weight", slice(start, start + inter)
        return None

    # --- mixture of experts (ModelArch.moe; layers where ModelArch.is_sparse) -------------------
    @property
    def router(self) -> np.ndarray:  # (H, E)
        moe = self.weights.config.moe
        assert moe is not None
        return self.weights.read(self.prefix + moe.router, transpose=True)

    def expert(self, e: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expert ``e``'s gate (H, I), up (H, I) and down (I, H) projections."""
        moe = self.weights.config.moe
        assert moe is not None
        base = self.prefix + moe.expert.format(e=e)
        gate, up, down = (self.weights.read(f"{base}{p}.weight", transpose=True) for p in moe.expert_proj)
        return gate, up, down

    def shared_expert(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The shared expert's gate (H, Is), up (H, Is), down (Is, H) and its gate (H, 1)."""
        read, p = self.weights.read, self.prefix + "mlp."
        return (read(p + "shared_expert.gate_proj.weight", True), read(p + "shared_expert.up_proj.weight", True),
                read(p + "shared_expert.down_proj.weight", True), read(p + "shared_expert_gate.weight", True))


_QKV = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")
_GATE_UP = ("mlp.gate_proj.weight", "mlp.up_proj.weight")


class ModelWeights:
    """A checkpoint's weights, read from the safetensors files one tensor per access.

    Nothing is cached: an access reads the tensor again, and the caller decides how long it
    lives, so a builder that converts and writes each tensor before asking for the next one
    holds about one tensor (plus what it fuses with it) at a time. Every expected tensor and its
    shape is checked against config.json from the file headers when this is created, before any
    data is read. Floating tensors come as ``dtype`` (float32, or float16 for a 16-bit engine).
    """

    def __init__(self, config: ModelArch, folder: Path, shards: list[Path],
                 dtype: np.dtype | type = np.float32) -> None:
        self.config, self.folder, self.dtype = config, folder, np.dtype(dtype)
        self.on_read: Callable[[str, int], None] | None = None  # (tensor name, bytes read)
        self._files: list[SafetensorsFile] = []
        try:
            self._files.extend(SafetensorsFile(shard) for shard in shards)
            self._where = self._locate(expected_shapes(config))
        except BaseException:
            self.close()
            raise
        self.layers = [LayerWeights(self, i) for i in range(config.num_layers)]

    def _locate(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, SafetensorsFile]:
        """The file of every expected tensor, its shape checked against config.json; a tensor
        the model would not use is refused (a checkpoint with weights we would leave out is
        not the model its files describe)."""
        where = {name: st for st in self._files for name in st.tensors}
        located: dict[str, SafetensorsFile] = {}
        for name, shape in shapes.items():
            st = where.get(name)
            if st is None:
                raise CheckpointError(self.folder, f"tensor {name!r} is missing from the weights")
            if st.tensors[name].shape != shape:
                raise CheckpointError(st.path, f"tensor {name!r} has shape "
                                      f"{st.tensors[name].shape}, config.json implies {shape}")
            located[name] = st
        unused = sorted(n for n in set(where) - set(shapes) if not self._ignorable(n, where))
        if unused:
            more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
            raise CheckpointError(where[unused[0]].path, f"tensor {unused[0]!r}{more} is not "
                                  f"used by {self.config.architecture} as config.json describes "
                                  "it; refusing rather than serving the model without it")
        return located

    def _ignorable(self, name: str, where: dict[str, SafetensorsFile]) -> bool:
        """Tensors transformers itself ignores when it loads these files: rotary tables some
        older savers stored (computed from config.json instead), and an ``lm_head.weight``
        equal to the embedding of a tied model (the head *is* the embedding)."""
        if name.endswith("rotary_emb.inv_freq"):
            return True
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            embed = "model.embed_tokens.weight"
            return embed in where and bool(np.array_equal(where[name].read(name), where[embed].read(embed)))
        return False

    def has(self, name: str) -> bool:
        """Whether the model has tensor ``name`` (as config.json describes it)."""
        return name in self._where

    def read(self, name: str, transpose: bool = False, rows: slice | None = None) -> np.ndarray:
        """Tensor ``name`` (a Hugging Face name), only ``rows`` of it (a fused projection's
        part), transposed to (in, out) when ``transpose``."""
        st = self._where[name]
        arr = st.read(name, self.dtype)
        if rows is not None:
            arr = arr[rows]
        # a fused tensor counts once, with its first part (build progress adds these up)
        if self.on_read is not None and (rows is None or rows.start == 0):
            self.on_read(name, st.tensors[name].end - st.tensors[name].begin)
        return np.ascontiguousarray(arr.T) if transpose else arr

    @property
    def embed(self) -> np.ndarray:  # (V, H)
        return self.read("model.embed_tokens.weight")

    @property
    def final_norm(self) -> np.ndarray:  # (H,)
        return self.read("model.norm.weight")

    @property
    def lm_head(self) -> np.ndarray:  # (H, V); the transposed embedding when tied
        if self.config.tie_word_embeddings:
            return self.read("model.embed_tokens.weight", transpose=True)
        return self.read("lm_head.weight", transpose=True)

    @property
    def tensor_names(self) -> list[str]:
        return list(self._where)

    @property
    def read_bytes(self) -> int:
        """Bytes a build reads: every tensor once, the embedding twice when tied (lm_head)."""
        size = {n: st.tensors[n].end - st.tensors[n].begin for n, st in self._where.items()}
        tied = size["model.embed_tokens.weight"] if self.config.tie_word_embeddings else 0
        return sum(size.values()) + tied

    def close(self) -> None:
        for st in self._files:
            st.close()

    def __enter__(self) -> ModelWeights:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def expected_shapes(cfg: ModelArch) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``cfg`` has, by Hugging Face name, in its stored shape
    ((out_features, in_features) for projections)."""
    h, d, inter, b = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.block
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "self_attn.o_proj.weight": (h, q),
                       p + "post_attention_layernorm.weight": (h,)})
        if b.fused_qkv:
            shapes[p + "self_attn.qkv_proj.weight"] = (q + 2 * kv, h)
        else:
            shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                           p + "self_attn.v_proj.weight": (kv, h)})
        if b.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        if b.sandwich_norms:
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
        if cfg.is_sparse(i):
            shapes.update(_moe_shapes(cfg, p))
        elif b.fused_gate_up:
            shapes.update({p + "mlp.gate_up_proj.weight": (2 * inter, h), p + "mlp.down_proj.weight": (h, inter)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                           p + "mlp.down_proj.weight": (h, inter)})
        if cfg.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if cfg.o_proj_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if cfg.mlp_bias:
            shapes.update({p + "mlp.gate_proj.bias": (inter,), p + "mlp.up_proj.bias": (inter,),
                           p + "mlp.down_proj.bias": (h,)})
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def _moe_shapes(cfg: ModelArch, p: str) -> dict[str, tuple[int, ...]]:
    """The router, every expert and the shared expert of a sparse layer (prefix ``p``)."""
    moe, h = cfg.moe, cfg.hidden_size
    assert moe is not None
    i = moe.intermediate_size
    gate, up, down = moe.expert_proj
    shapes: dict[str, tuple[int, ...]] = {p + moe.router: (moe.num_experts, h)}
    for e in range(moe.num_experts):
        base = p + moe.expert.format(e=e)
        shapes.update({f"{base}{gate}.weight": (i, h), f"{base}{up}.weight": (i, h), f"{base}{down}.weight": (h, i)})
    if moe.shared_expert:
        s = moe.shared_intermediate_size
        shapes.update({p + "mlp.shared_expert.gate_proj.weight": (s, h), p + "mlp.shared_expert.up_proj.weight": (s, h),
                       p + "mlp.shared_expert.down_proj.weight": (h, s), p + "mlp.shared_expert_gate.weight": (1, h)})
    return shapes


class Checkpoint:
    """A checkpoint folder: its config, tokenizer, generation defaults and (lazily) weights.

    ``generation_config``: where request defaults and extra EOS ids come from (``"auto"``: the
    folder's generation_config.json, ``"none"``, or a folder; ``models/generation_config.py``).
    """

    def __init__(self, path: Path | str, generation_config: str = "auto") -> None:
        self.path = Path(path).expanduser().resolve()
        if not self.path.is_dir():
            raise CheckpointError(self.path, "checkpoint folder does not exist")
        self.config: ModelArch = parse_model_config(self.path / "config.json")
        self.shards = list(iter_shards(self.path))
        for shard in self.shards:
            if not shard.exists():
                raise CheckpointError(shard, "weights shard listed in the index is missing")
        self.generation: GenerationDefaults = load_generation_defaults(
            self.path, generation_config
        )

    @property
    def name(self) -> str:
        return self.path.name

    @cached_property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer(self.path)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end generation: config.json's, the tokenizer's EOS and the generation
        config's (unless its mode is none)."""
        ids = set(self.config.eos_token_ids) | set(self.generation.eos_token_ids)
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

    def open_weights(self, dtype: np.dtype | type = np.float32) -> ModelWeights:
        """The weights, read tensor by tensor as they are used (see ``ModelWeights``; close it,
        or use it as a context manager); files, tensor names and shapes are checked now."""
        return ModelWeights(self.config, self.path, self.shards, dtype)


def load_checkpoint(path: Path | str, generation_config: str = "auto") -> Checkpoint:
    """Open a checkpoint folder (config, file layout and the generation config are checked now;
    weights load lazily). Settings of the generation config inferflow cannot apply are logged
    once here."""
    checkpoint = Checkpoint(path, generation_config)
    warn_not_applied(checkpoint.generation, checkpoint.name)
    return checkpoint
