"""Multi-LoRA in the ONNX Runtime engine (issue 43): the graph's LoRA inputs and deltas
(``models/llama_graph``), the runners' slots (``runtimes/ort_lora``), both CPU graph forms.

Oracle: a tiny seeded Llama and two random PEFT adapters made by peft
(``inferflow.testing.lora``); each adapter's greedy output through the runner equals
transformers + ``peft.PeftModel``, alone and in mixed steps (the base model and the other adapter
beside it, prefill chunks and decode rows in one ``forward``), and the merged-weights reference
agrees. A family with a head layout (Phi-3's partial rotary permutes q and k's columns) and
one with q/k norms are checked against the same model with the delta merged into its weights.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from inferflow.lora.adapter import LORA_TARGETS, LoraAdapter, LoraSpec
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.llama_graph import GRAPH_BUILDER_VERSION, GraphSpec, build_llama_graph
from inferflow.models.safetensors_writer import save_safetensors
from inferflow.models.tiny import make_checkpoint
from inferflow.runtimes.config import OrtSettings
from inferflow.runtimes.onnxruntime_paged import PagedOnnxRuntimeRunner
from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner, OrtEngine
from inferflow.runtimes.ort_lora import projection_dims
from inferflow.runtimes.ort_ops.build import op_status
from inferflow.runtimes.step_inputs import EngineRow
from inferflow.scheduling.layout import KVLayout

FORMS = [pytest.param("paged", marks=pytest.mark.skipif(
    not op_status()[0], reason=f"paged-attention op: {op_status()[1]}")), "gqa"]
SPEC = LoraSpec(max_loras=3, max_lora_rank=8)
N_NEW = 8
MAX_SLOTS, MAX_LEN, BLOCK = 6, 128, 8

# name -> make_checkpoint overrides: multi-head attention with the MLP's 4 KiB-row padding
# (intermediate 1024 in fp32: the graph pads it to 1056), and grouped-query attention without
SHAPES: dict[str, dict[str, int]] = {
    "mha": {"num_kv_heads": 4, "intermediate_size": 1024},
    "gqa": {"num_kv_heads": 2, "intermediate_size": 192},
}


def checkpoint(root: Path, name: str) -> Path:
    path = root / name
    if not (path / "config.json").exists():
        make_checkpoint(path, num_layers=2, hidden_size=64, num_heads=4, vocab_size=512, seed=5,
                        **SHAPES[name])  # type: ignore[arg-type]
    return path


def runner(path: Path, form: str, engine_dir: Path, lora: LoraSpec | None = SPEC,
           **settings: object) -> OrtEngine:
    paged = form == "paged"
    layout = KVLayout.plan(MAX_SLOTS, MAX_LEN, BLOCK, 0, paged=paged)
    cls = PagedOnnxRuntimeRunner if paged else OnnxRuntimeRunner
    options = OrtSettings(graph_form=form, cache_dir=str(engine_dir), **settings)  # type: ignore[arg-type]
    return cls(load_checkpoint(path), options, layout, lora=lora)


def table(engine: OrtEngine, slot: int) -> tuple[int, ...]:
    """Slot ``slot``'s blocks on a paged engine (scattered over the pool), () on slots."""
    if not isinstance(engine, PagedOnnxRuntimeRunner):
        return ()
    per_slot = -(-MAX_LEN // BLOCK)
    order = np.random.default_rng(3).permutation(engine.layout.num_blocks)
    return tuple(int(b) for b in order[slot * per_slot:(slot + 1) * per_slot])


@dataclass
class Seq:
    """One sequence driven through ``run_steps``: its prompt, LoRA slot (-1: base), KV slot,
    the step it starts at and its prefill chunk size."""

    prompt: list[int]
    lora_slot: int
    slot: int
    start: int = 0
    chunk: int = 1000
    pos: int = 0
    out: list[int] = field(default_factory=list)


def run_steps(engine: OrtEngine, seqs: list[Seq], n_new: int = N_NEW) -> list[list[int]]:
    """Greedy-decode every sequence, all of them in each ``forward`` call from their start step
    on (prefill chunks and decode rows of different adapters side by side)."""
    step, mixed = 0, 0
    while any(len(s.out) < n_new for s in seqs):
        rows, owners = [], []
        for s in seqs:
            if step < s.start or len(s.out) >= n_new:
                continue
            if s.pos < len(s.prompt):
                tokens = s.prompt[s.pos:s.pos + s.chunk]
                sample = s.pos + len(tokens) == len(s.prompt)
            else:
                tokens, sample = [s.out[-1]], True
            rows.append(EngineRow(s.slot, tuple(tokens), s.pos, sample, table(engine, s.slot),
                                  lora_slot=s.lora_slot))
            owners.append(s)
        logits = engine.forward(rows)
        at = 0
        for row, s in zip(rows, owners, strict=True):
            s.pos += len(row.token_ids)
            if row.sample:
                s.out.append(int(logits[at].argmax()))
                at += 1
        kinds = {len(r.token_ids) > 1 for r in rows}
        mixed += len(kinds) == 2 and len({r.lora_slot for r in rows}) > 2
        step += 1
    assert len(seqs) == 1 or mixed, "no step mixed prefill chunks, decode rows and adapters"
    return [s.out for s in seqs]


PROMPTS = [[7, 99, 3, 250, 41, 17, 300, 8, 9, 123, 77],
           [5, 1, 400, 22, 61, 18, 2],
           [13, 14, 15, 200, 201, 202, 90, 91, 92, 311, 312, 313, 60, 61, 62, 33, 34, 35, 36, 37]]


@dataclass(frozen=True)
class Oracle:
    base: Path
    adapters: tuple[Path, Path]
    base_tokens: list[list[int]]
    peft_tokens: tuple[list[list[int]], list[list[int]]]


@pytest.fixture(scope="module", params=list(SHAPES))
def oracle(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Oracle:
    """A seeded checkpoint, two peft adapters (rank 8 on every target; rank 4 rsLoRA on some)
    and transformers' greedy tokens of every prompt: base, and through each adapter
    (``PeftModel``), checked against the merged weights' (``merge_and_unload``)."""
    pytest.importorskip("peft")
    from inferflow.testing.lora import (
        base_reference,
        make_peft_adapter,
        merged_reference,
        peft_reference,
    )

    root = tmp_path_factory.mktemp(f"lora_{request.param}")
    base = checkpoint(root, request.param)
    a1 = make_peft_adapter(base, root / "a1", rank=8, alpha=16, seed=1)
    a2 = make_peft_adapter(base, root / "a2", rank=4, alpha=8, seed=2, rslora=True,
                           targets=("q_proj", "v_proj", "o_proj", "up_proj", "down_proj"))
    base_tokens = base_reference(base, PROMPTS, N_NEW)
    peft_tokens = (peft_reference(base, a1, PROMPTS, N_NEW), peft_reference(base, a2, PROMPTS, N_NEW))
    for adapter, tokens in zip((a1, a2), peft_tokens, strict=True):
        assert merged_reference(base, adapter, PROMPTS, N_NEW) == tokens
        assert tokens != base_tokens  # the adapter changes the output
    assert peft_tokens[0] != peft_tokens[1]
    return Oracle(base, (a1, a2), base_tokens, peft_tokens)


def load_adapter(path: Path, name: str, base: Path) -> LoraAdapter:
    """The PEFT adapter at ``path`` as the engine takes it (``load_peft_adapter``)."""
    from inferflow.lora.adapter import load_peft_adapter

    return load_peft_adapter(path, name, load_checkpoint(base).config, SPEC)


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_each_adapter_alone_and_mixed_equals_peft(oracle: Oracle, form: str, tmp_path: Path) -> None:
    engine = runner(oracle.base, form, tmp_path)
    assert engine.lora_spec == SPEC
    engine.set_lora(2, load_adapter(oracle.adapters[0], "a1", oracle.base))  # slots 2 and 0
    engine.set_lora(0, load_adapter(oracle.adapters[1], "a2", oracle.base))
    lora_slot = {None: -1, 0: 2, 1: 0}
    want = {None: oracle.base_tokens, 0: oracle.peft_tokens[0], 1: oracle.peft_tokens[1]}
    # alone: one sequence per run, the whole prompt in one chunk
    for adapter in (None, 0, 1):
        for p, prompt in enumerate(PROMPTS):
            got = run_steps(engine, [Seq(prompt, lora_slot[adapter], slot=p)])
            assert got == [want[adapter][p]], (adapter, p)
    # mixed: every (prompt, adapter) pair at once, staggered starts and small chunks, so steps
    # hold prefill chunks and decode rows of the base model and both adapters
    every = [(p, adapter) for p in range(len(PROMPTS)) for adapter in (None, 0, 1)]
    pairs = every[:MAX_SLOTS]
    seqs = [Seq(PROMPTS[p], lora_slot[adapter], slot=k, start=k % 3, chunk=3 + k)
            for k, (p, adapter) in enumerate(pairs)]
    got = run_steps(engine, seqs)
    assert got == [want[adapter][p] for p, adapter in pairs]
    # and the other mix: the remaining pairs, adapters moved to other slots
    rest = every[MAX_SLOTS:]
    engine.set_lora(1, load_adapter(oracle.adapters[1], "a2", oracle.base))
    engine.set_lora(0, None)
    lora_slot[1] = 1
    seqs = [Seq(PROMPTS[p], lora_slot[adapter], slot=k, start=(2 - k) % 3, chunk=4)
            for k, (p, adapter) in enumerate(rest)]
    assert run_steps(engine, seqs) == [want[adapter][p] for p, adapter in rest]


# --- the graph ----------------------------------------------------------------------------------

# sha256 (first 16 hex digits) of the graphs without LoRA of the checkpoint below, built by
# GRAPH_BUILDER_VERSION "6" before LoRA existed: a graph without LoRA is node for node the same
# (version "7" changed the canonical form only: a static KV length, TensorScatter axis -2;
# its digest was re-pinned then, the other forms' are version 6's)
PINNED = {("gqa", "fp32"): "0f3fed0477e1debb", ("paged", "fp32"): "8ba1d224be575b70",
          ("gqa", "int8"): "1a8a0fe21e3cc753", ("canonical", "fp32"): "d4442b9d6a8815a0"}


@pytest.mark.parametrize(("form", "precision"), list(PINNED))
def test_a_graph_without_lora_is_unchanged(tmp_path: Path, form: str, precision: str) -> None:
    assert GRAPH_BUILDER_VERSION == "7"  # a new version may change the graph: re-pin
    ck = load_checkpoint(make_checkpoint(tmp_path / "m", num_layers=2, hidden_size=64, num_heads=4,
                                         num_kv_heads=2, intermediate_size=1024, vocab_size=512, seed=3))
    with ck.open_weights(np.float32) as weights:
        model = build_llama_graph(ck.config, weights, GraphSpec(form, precision, 128))  # type: ignore[arg-type]
    digest = hashlib.sha256(model.graph.SerializeToString(deterministic=True)).hexdigest()[:16]
    assert digest == PINNED[(form, precision)]
    assert not any("lora" in name for node in model.graph.node for name in node.input)


@pytest.mark.parametrize(("form", "precision"), [("gqa", "fp32"), ("paged", "fp16"), ("gqa", "int4")])
def test_the_lora_inputs(tmp_path: Path, form: str, precision: str) -> None:
    """lora_mask, then A and B of each layer's targets, at the activations' type; gate and up's
    B and down's A as wide as the padded MLP."""
    ck = load_checkpoint(checkpoint(tmp_path, "mha"))
    spec = LoraSpec(2, 4, ("k_proj", "o_proj", "gate_proj", "down_proj"))
    dtype = np.float16 if precision == "fp16" else np.float32
    with ck.open_weights(dtype) as weights:
        model = build_llama_graph(ck.config, weights, GraphSpec(form, precision, 128, lora=spec))  # type: ignore[arg-type]
    elem = 10 if precision == "fp16" else 1  # TensorProto.FLOAT16 / FLOAT
    shapes = {i.name: [d.dim_value or d.dim_param for d in i.type.tensor_type.shape.dim]
              for i in model.graph.input if "lora" in i.name}
    assert all(i.type.tensor_type.elem_type == elem for i in model.graph.input if "lora" in i.name)
    inter = 1056 if precision == "fp32" else 1024  # 4 KiB rows padded: fp32 (not fp16, int4)
    want: dict[str, list[object]] = {"lora_mask": ["N", 8]}
    for i in range(2):
        want |= {f"lora_a_k_proj_{i}": [64, 8], f"lora_b_k_proj_{i}": [8, 64],
                 f"lora_a_o_proj_{i}": [64, 8], f"lora_b_o_proj_{i}": [8, 64],
                 f"lora_a_gate_proj_{i}": [64, 8], f"lora_b_gate_proj_{i}": [8, inter],
                 f"lora_a_down_proj_{i}": [inter, 8], f"lora_b_down_proj_{i}": [8, 64]}
    assert shapes == want and list(shapes) == list(want)


def test_the_canonical_form_and_moe_mlp_targets_are_refused(tmp_path: Path) -> None:
    from engine.hf_checkpoints import save_hf_checkpoint

    ck = load_checkpoint(checkpoint(tmp_path, "gqa"))
    with pytest.raises(ValueError, match="graph_form gqa or paged, not canonical"):
        runner(ck.path, "canonical", tmp_path)
    with ck.open_weights(np.float32) as weights, pytest.raises(ValueError, match="CPU graph form"):
        build_llama_graph(ck.config, weights, GraphSpec("canonical", lora=SPEC))
    cfg = load_checkpoint(save_hf_checkpoint(tmp_path / "moe", "MixtralForCausalLM", num_local_experts=4,
                                             num_experts_per_tok=2)).config
    from inferflow.models.llama_graph import check_lora

    with pytest.raises(ValueError, match=r"\['gate_proj', 'up_proj', 'down_proj'\]: layers .* sparse"):
        check_lora(cfg, GraphSpec("gqa", lora=SPEC))
    check_lora(cfg, GraphSpec("gqa", lora=LoraSpec(2, 8, ("q_proj", "v_proj"))))


# --- the slots ------------------------------------------------------------------------------------

def random_adapter(name: str, cfg_path: Path, rank: int, targets: tuple[str, ...], seed: int,
                   scaling: float = 2.0, layers: tuple[int, ...] = (0, 1)) -> LoraAdapter:
    """A LoraAdapter of random numpy A, B (the update about 0.1 per entry)."""
    rng = np.random.default_rng(seed)
    dims = projection_dims(load_checkpoint(cfg_path).config)
    weights = {}
    for layer in layers:
        for t in targets:
            d_in, d_out = dims[t]
            a = rng.standard_normal((d_in, rank)).astype(np.float32) / np.sqrt(d_in)
            b = rng.standard_normal((rank, d_out)).astype(np.float32) * 0.1 / scaling / np.sqrt(rank)
            weights[(layer, t)] = (a, b)
    return LoraAdapter(name, cfg_path, rank, scaling, weights)


HF_NAMES = {t: ("self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp", t)
            for t in LORA_TARGETS}


def merged_checkpoint(base: Path, out: Path, adapter: LoraAdapter) -> Path:
    """``base`` with ``scaling * (A @ B)`` added to each target's weights (transformers' layout
    (d_out, d_in); fused qkv_proj / gate_up_proj rows of Phi-3 as they are stacked)."""
    from safetensors.numpy import load_file

    shutil.copytree(base, out)
    tensors = load_file(base / "model.safetensors")
    cfg = load_checkpoint(base).config
    qw, kw, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    fused = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", qw), "v_proj": ("qkv_proj", qw + kw),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", inter)}
    for (layer, target), (a, b) in adapter.weights.items():
        delta = adapter.scaling * (a @ b).T  # (d_out, d_in)
        module, name = HF_NAMES[target]
        key = f"model.layers.{layer}.{module}.{name}.weight"
        if key in tensors:
            tensors[key] = tensors[key] + delta
        else:
            fused_name, row = fused[target]
            key = f"model.layers.{layer}.{module}.{fused_name}.weight"
            tensors[key] = tensors[key].copy()
            tensors[key][row:row + delta.shape[0]] += delta
    (out / "model.safetensors").unlink()
    save_safetensors(tensors, out / "model.safetensors", "float32")
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    return out


def logits_of(engine: OrtEngine, lora_slot: int, prompt: list[int], n: int = 4) -> np.ndarray:
    """The logits of a prefill and ``n`` greedy decode steps of one sequence in slot 0."""
    t = table(engine, 0)
    out = [engine.forward([EngineRow(0, tuple(prompt), 0, True, t, lora_slot=lora_slot)])[0]]
    pos = len(prompt)
    for _ in range(n):
        out.append(engine.forward([EngineRow(0, (int(out[-1].argmax()),), pos, True, t,
                                             lora_slot=lora_slot)])[0])
        pos += 1
    return np.stack(out)


def family_checkpoint(root: Path, name: str) -> Path:
    """Phi-3 with partial rotary (the gqa form permutes q and k's head dims) or Qwen3 (q/k
    norms after the projection), saved by transformers."""
    from engine.hf_checkpoints import save_hf_checkpoint

    if name == "phi3_partial_rotary":
        return save_hf_checkpoint(root / name, "Phi3ForCausalLM", rope_parameters={
            "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75})
    return save_hf_checkpoint(root / name, "Qwen3ForCausalLM", head_dim=16)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("name", ["mha", "gqa", "phi3_partial_rotary", "qwen3"])
def test_the_delta_equals_merged_weights(tmp_path: Path, form: str, name: str) -> None:
    """Through every target, any rank <= R, in any slot: the logits of the model with the
    adapter merged into its weights (no LoRA in that engine)."""
    base = checkpoint(tmp_path, name) if name in SHAPES else family_checkpoint(tmp_path, name)
    adapter = random_adapter("x", base, rank=5, targets=LORA_TARGETS, seed=4)
    merged = merged_checkpoint(base, tmp_path / "merged", adapter)
    prompt = [3, 17, 99, 4, 250, 31, 8]
    engine = runner(base, form, tmp_path / "engines")
    engine.set_lora(1, random_adapter("y", base, 8, ("q_proj",), 9))  # another slot: not read
    engine.set_lora(2, adapter)
    want = logits_of(runner(merged, form, tmp_path / "engines", lora=None), -1, prompt)
    got = logits_of(engine, 2, prompt)
    np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    base_logits = logits_of(engine, -1, prompt)
    assert np.abs(base_logits - want).max() > 1e-2  # the adapter matters
    engine.set_lora(2, None)  # cleared: slot 2 may not be used; slot 1 still serves
    with pytest.raises(ValueError, match="slot 2: the slot holds no adapter"):
        logits_of(engine, 2, prompt)
    np.testing.assert_allclose(logits_of(runner(base, form, tmp_path / "engines", lora=None), -1, prompt),
                               base_logits, atol=1e-5, rtol=1e-5)


def test_set_lora_checks_before_writing(tmp_path: Path) -> None:
    base = checkpoint(tmp_path, "gqa")
    engine = runner(base, "gqa", tmp_path, lora=LoraSpec(2, 4, ("q_proj", "v_proj")))
    assert engine.lora_slots is not None
    good = random_adapter("good", base, 4, ("q_proj", "v_proj"), 1)
    engine.set_lora(0, good)
    before = {k: v.copy() for k, v in engine.lora_slots.buffers.items()}
    with pytest.raises(ValueError, match="rank 8 > max_lora_rank 4"):
        engine.set_lora(0, random_adapter("big", base, 8, ("q_proj",), 1))
    with pytest.raises(ValueError, match="layer 0 o_proj is not a target of this engine"):
        engine.set_lora(0, random_adapter("o", base, 4, ("q_proj", "o_proj"), 1))
    with pytest.raises(ValueError, match=r"LoRA slot 2 outside \[0, 2\)"):
        engine.set_lora(2, good)
    assert all(np.array_equal(before[k], v) for k, v in engine.lora_slots.buffers.items())
    with pytest.raises(ValueError, match=r"lora_slot 5 outside \[-1, 2\)"):
        engine.forward([EngineRow(0, (1, 2), 0, True, lora_slot=5)])
    # a smaller rank fills the slot's first columns; the rest of the slot is zero
    engine.set_lora(0, random_adapter("r2", base, 2, ("v_proj",), 2))
    a = engine.lora_slots.buffers["lora_a_v_proj_1"]
    assert a[:, :2].any() and not a[:, 2:4].any() and not engine.lora_slots.buffers["lora_a_q_proj_0"][:, :4].any()
    plain = runner(base, "gqa", tmp_path, lora=None)
    assert plain.lora_spec is None and "lora_max_loras" not in plain.cache_fields(load_checkpoint(base))
    assert engine.cache_fields(load_checkpoint(base))["lora_max_loras"] == 2
    assert plain.cache_entry.model_path != engine.cache_entry.model_path
    with pytest.raises(ValueError, match="built without LoRA"):
        plain.set_lora(0, good)
    with pytest.raises(ValueError, match="built without LoRA"):
        plain.forward([EngineRow(0, (1, 2), 0, True, lora_slot=0)])


def test_the_mask_follows_the_packed_tokens(tmp_path: Path) -> None:
    base = checkpoint(tmp_path, "gqa")
    engine = runner(base, "gqa", tmp_path, lora=LoraSpec(3, 2, ("q_proj",)))
    assert engine.lora_slots is not None
    engine.set_lora(0, random_adapter("a", base, 2, ("q_proj",), 1, scaling=0.5))
    engine.set_lora(2, random_adapter("b", base, 1, ("q_proj",), 2, scaling=3.0))
    rows = [EngineRow(0, (1, 2, 3), 0, True, lora_slot=2), EngineRow(1, (4,), 5, True),
            EngineRow(2, (5, 6), 0, False, lora_slot=0)]
    mask = engine.lora_slots.mask(rows, 8)  # 6 tokens, then 2 of padding
    want = np.zeros((8, 6), np.float32)
    want[0:3, 4:6] = 3.0  # slot 2 (its rank-1 adapter's scaling on all R columns: zero B rows)
    want[4:6, 0:2] = 0.5
    np.testing.assert_array_equal(mask, want)
