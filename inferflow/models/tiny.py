"""Small seeded Llama checkpoints in Hugging Face layout, made offline in about a second, and the
embedded default model.

``make_checkpoint`` writes a random-weight Llama (any shape) with a byte-level BPE tokenizer
trained on a fixed corpus: same arguments -> byte-identical files (the tests' factory for shapes).
``tiny_llama_path()`` is the embedded default model, a small Llama *trained* on the Python
documentation (committed in ``inferflow/models/tiny_llama/``), placed on first use under
``$INFERFLOW_HOME`` (default ``~/.cache/inferflow``) so ``python -m inferflow`` and the tests work
on a fresh offline machine.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from inferflow.models.config_fields import ARCHITECTURES
from inferflow.models.safetensors_writer import round_to_dtype, save_safetensors
from inferflow.models.tiny_corpus import CORPUS
from inferflow.paths import inferflow_home

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]

# Llama 3 style template (what transformers renders for Llama 3.1 Instruct, minus tool calls).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of a generated checkpoint (defaults: the embedded ``tiny_llama``)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    vocab_size: int = 1024
    max_position_embeddings: int = 2048
    rope_theta: float = 500000.0
    llama3_rope_scaling: bool = True
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-5
    architecture: str = "LlamaForCausalLM"
    attention_bias: bool = False
    head_dim: int | None = None


# A ~100M-parameter Llama (12 layers, hidden 768, vocab 16,384): the benchmarks' mid-size model.
SPEC_100M = TinySpec(
    hidden_size=768,
    intermediate_size=2048,
    num_layers=12,
    num_heads=12,
    num_kv_heads=4,
    vocab_size=16384,
)

# A ~4.5M-parameter Llama (6 layers, hidden 256, vocab 1,024): per-step overhead, not compute,
# bounds it on a CPU, so it is the benchmarks' probe of the serving path itself.
SPEC_4M5 = TinySpec(
    hidden_size=256,
    intermediate_size=640,
    num_layers=6,
    num_heads=8,
    num_kv_heads=2,
    vocab_size=1024,
)


def _filler_text(num_words: int = 60000, seed: int = 1234) -> str:
    """Seeded pseudo-words: enough distinct substrings for BPE to learn up to ~100k tokens (the
    small English corpus alone stops at 869, and ids without a token decode to nothing)."""
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join(
        "".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(num_words)
    )


def train_tokenizer(vocab_size: int, out: Path, texts: list[str] | None = None) -> None:
    """Byte-level BPE trained to exactly ``vocab_size`` tokens on ``texts`` (default: the fixed
    corpus plus seeded filler words); writes tokenizer.json + tokenizer_config.json. Raises
    ``ValueError`` for a vocabulary the corpus cannot train (every model id must have a token).

    BOS is placed by tokenizer.json's post-processor (``TemplateProcessing``, as Llama 3's files
    do): transformers 5 honours only that, not ``add_bos_token`` (kept, as Llama files carry it).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts if texts is not None else [CORPUS] * 4 + [_filler_text()],
                            trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(
            f"vocab_size: {vocab_size} tokens cannot be trained from the built-in corpus (it "
            f"gives {tok.get_vocab_size()}); use a vocab_size of at most {tok.get_vocab_size()}"
        )
    bos = SPECIAL_TOKENS[0]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE, "model_max_length": 2048,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _random_weights(spec: TinySpec, head_dim: int, seed: int) -> dict[str, np.ndarray]:
    """Seeded weights scaled so logits are peaked (greedy decoding is then robust to round-off)."""
    rng = np.random.default_rng(seed)
    h, i, v = spec.hidden_size, spec.intermediate_size, spec.vocab_size

    def lin(out_f: int, in_f: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((out_f, in_f)) * gain / np.sqrt(in_f)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32)}
    for n in range(spec.num_layers):
        p = f"model.layers.{n}."
        w[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[p + "post_attention_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
        w[p + "self_attn.q_proj.weight"] = lin(spec.num_heads * head_dim, h, 2.0)
        w[p + "self_attn.k_proj.weight"] = lin(spec.num_kv_heads * head_dim, h, 2.0)
        w[p + "self_attn.v_proj.weight"] = lin(spec.num_kv_heads * head_dim, h)
        w[p + "self_attn.o_proj.weight"] = lin(h, spec.num_heads * head_dim, 0.5)
        w[p + "mlp.gate_proj.weight"] = lin(i, h)
        w[p + "mlp.up_proj.weight"] = lin(i, h)
        w[p + "mlp.down_proj.weight"] = lin(h, i, 0.5)
        if spec.attention_bias or spec.architecture == "Qwen2ForCausalLM":  # Qwen2: always q/k/v
            for name, width in (("q", spec.num_heads), ("k", spec.num_kv_heads), ("v", spec.num_kv_heads)):
                w[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(width * head_dim)).astype(np.float32)
        if spec.attention_bias and spec.architecture == "LlamaForCausalLM":  # Llama: o too
            w[p + "self_attn.o_proj.bias"] = (0.1 * rng.standard_normal(h)).astype(np.float32)
    w["model.norm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    if not spec.tie_word_embeddings:
        w["lm_head.weight"] = lin(v, h, 4.0)
    return w


ConfigFormat = Literal["v5", "legacy"]


def config_json(spec: TinySpec, head_dim: int, dtype: str, config_format: ConfigFormat = "v5") -> dict:
    """config.json of ``spec`` as transformers 5 writes it (``rope_parameters``, ``dtype``) or,
    with ``config_format="legacy"``, as transformers 4 did (``rope_theta`` + ``rope_scaling``,
    ``torch_dtype``)."""
    cfg = {
        "architectures": [spec.architecture],
        "model_type": ARCHITECTURES[spec.architecture].model_type,
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": head_dim, "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings, "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 0, "eos_token_id": 4,  # ids of <|begin_of_text|> and <|eot_id|>
        "initializer_range": 0.02, "use_cache": True,
    }
    if spec.architecture == "LlamaForCausalLM":
        cfg.update(attention_bias=spec.attention_bias, mlp_bias=False)
    if spec.architecture == "MistralForCausalLM":
        cfg["sliding_window"] = None
    if spec.architecture == "Qwen2ForCausalLM":
        cfg["use_sliding_window"] = False
    scaling = None
    if spec.llama3_rope_scaling:
        scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": max(spec.max_position_embeddings // 4, 16)}
    if config_format == "legacy":
        cfg.update(rope_theta=spec.rope_theta, torch_dtype=dtype)
        if scaling:
            cfg["rope_scaling"] = scaling
    else:
        cfg.update(rope_parameters={"rope_theta": spec.rope_theta, **(scaling or {"rope_type": "default"})},
                   dtype=dtype)
    return cfg


def make_checkpoint(path: Path | str, spec: TinySpec | None = None, *, seed: int = 0,
                    dtype: str = "float32", shards: int = 1, config_format: ConfigFormat = "v5",
                    **overrides: object) -> Path:
    """Write a seeded random-weight checkpoint to ``path`` (created) and return it.

    ``dtype`` is the safetensors storage type (float32, float16, bfloat16); ``shards > 1`` writes
    ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``; ``config_format``:
    config.json as transformers 5 writes it (``"v5"``) or as transformers 4 did (``"legacy"``).
    """
    spec = spec or TinySpec()
    if overrides:
        spec = TinySpec(**{**asdict(spec), **overrides})  # type: ignore[arg-type]
    head_dim = spec.head_dim or spec.hidden_size // spec.num_heads
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    train_tokenizer(spec.vocab_size, out)  # first: a vocabulary it cannot train is refused
    weights = _random_weights(spec, head_dim, seed)
    config = config_json(spec, head_dim, dtype, config_format)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_weights(weights, out, dtype, shards)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 4, "do_sample": False}, indent=2))
    return out


def _write_weights(weights: dict[str, np.ndarray], out: Path, dtype: str, shards: int) -> None:
    weights = {k: round_to_dtype(v, dtype) for k, v in weights.items()}
    if shards <= 1:
        save_safetensors(weights, out / "model.safetensors", dtype)
        return
    names = sorted(weights)
    weight_map: dict[str, str] = {}
    for k in range(shards):
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[k::shards]}
        save_safetensors(part, out / fname, dtype)
        weight_map.update(dict.fromkeys(part, fname))
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


# v4: tokenizer.json's post-processor places BOS (as transformers 5 reads it); v3: trained on
# the Python docs; v2: random weights, a full vocabulary
TINY_LLAMA_VERSION = "v4"
TRAINED = Path(__file__).with_name("tiny_llama")  # the committed checkpoint (see its README.md)
CHECKPOINT_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json")


def tiny_llama_path() -> Path:
    """The embedded default model: the trained checkpoint shipped in the package
    (``inferflow/models/tiny_llama/``, made by ``scripts/train_tiny_llama.py``), copied on first
    use under ``$INFERFLOW_HOME/models`` (atomic rename), so every start finds it at one path."""
    target = inferflow_home() / "models" / f"tiny_llama-{TINY_LLAMA_VERSION}"
    if (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny_llama-", dir=target.parent))
    try:
        for name in CHECKPOINT_FILES:
            shutil.copyfile(TRAINED / name, tmp / name)
        # another process may win the race; its files are identical to ours
        with contextlib.suppress(OSError):
            tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
