"""Multi-LoRA in the torch executor's engine (``TorchRunner(..., lora=LoraSpec)``, issue 43).

Oracles, on tiny seeded Llamas (GQA 8x2, MHA, Qwen2 with q/k/v biases): the adapter's weights
merged into a copy of the checkpoint (``W += scaling * (A @ B)``), run by transformers; and, where
peft is installed, transformers + ``peft.PeftModel`` on a PEFT adapter folder. Each adapter's
greedy tokens equal the oracle's token for token and the fp32 logits agree, alone and in steps
that mix the base model, both adapters, prefill chunks and decode rows; ``set_lora`` writes in
place (no new storage, no recompile), pads ranks, clears slots and refuses what does not fit.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from inferflow.lora import LORA_TARGETS, LoraAdapter, LoraSpec
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.config import ModelArch
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.runtimes.step_inputs import EngineRow
from inferflow.scheduling.layout import KVLayout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from inferflow.runtimes.config import TorchSettings  # noqa: E402
from inferflow.runtimes.torch_engine.runner import TorchRunner  # noqa: E402
from inferflow.runtimes.torch_engine.step_batch import (  # noqa: E402
    LoraScales,
    build_step_batch,
)

N_NEW = 12
BLOCK = 8
ATOL = 2e-3  # fp32 logits: round-off of a different summation order, not a different computation
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")

# name -> make_checkpoint overrides
MODELS: dict[str, dict[str, object]] = {
    "gqa8x2": {},
    "mha": {"num_kv_heads": 8, "llama3_rope_scaling": False, "rope_theta": 10000.0},
    "qwen2_bias": {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch_lora")


def model(root: Path, name: str) -> Path:
    path = root / name
    if not (path / "tokenizer.json").exists():
        make_checkpoint(path, TinySpec(num_layers=2, **MODELS[name]), seed=3)  # type: ignore[arg-type]
    return path


def random_adapter(arch: ModelArch, name: str, *, rank: int, alpha: float, seed: int,
                   targets: Sequence[str] = LORA_TARGETS,
                   layers: Sequence[int] | None = None) -> LoraAdapter:
    """An adapter with random A (d_in, r) and B (r, d_out), large enough to change the output."""
    rng = np.random.default_rng(seed)
    h, i = arch.hidden_size, arch.intermediate_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
    weights = {}
    for layer in range(arch.num_layers) if layers is None else layers:
        for target in targets:
            d_in, d_out = shapes[target]
            a = rng.normal(0, d_in ** -0.5, (d_in, rank)).astype(np.float32)
            b = rng.normal(0, 0.1, (rank, d_out)).astype(np.float32)
            weights[(layer, target)] = (a, b)
    return LoraAdapter(name, Path(name), rank, alpha / rank, weights)


def merged_checkpoint(base: Path, adapter: LoraAdapter, out: Path) -> Path:
    """A copy of ``base`` with ``W += scaling * (A @ B)`` in every trained projection."""
    from safetensors.numpy import load_file, save_file

    if out.exists():
        return out
    shutil.copytree(base, out)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    for (layer, target), (a, b) in adapter.weights.items():
        kind = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
        key = f"model.layers.{layer}.{kind}.{target}.weight"  # (d_out, d_in)
        tensors[key] = (tensors[key] + adapter.scaling * (a @ b).T).astype(tensors[key].dtype)
    save_file(tensors, files[0], metadata={"format": "pt"})
    return out


_REFERENCES: dict[tuple[Path, tuple[int, ...]], tuple[list[int], np.ndarray]] = {}


def reference(path: Path, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after ``prompt`` and the fp32 logits of every position."""
    key = (path, tuple(prompt))
    if key not in _REFERENCES:
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _REFERENCES[key] = generate(hf, prompt)
    return _REFERENCES[key]


def generate(hf: object, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids),  # type: ignore[attr-defined]
                          max_new_tokens=N_NEW, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        full = out[0].tolist()
        logits = hf(torch.tensor([full])).logits[0].float().numpy()  # type: ignore[operator]
    return full[len(prompt):], logits


def make_runner(path: Path, tmp_path: Path, spec: LoraSpec | None, compile: str = "eager",
                num_blocks: int = 48) -> TorchRunner:
    layout = KVLayout(4, 128, BLOCK, num_blocks, paged=True)
    settings = TorchSettings(compile=compile, cache_dir=str(tmp_path / "engines"))
    return TorchRunner(load_checkpoint(path), settings, layout, lora=spec)


@dataclass
class Seq:
    """One sequence driven through the runner: its prompt, adapter slot and KV blocks."""

    prompt: list[int]
    lora_slot: int
    table: tuple[int, ...]
    chunk: int  # prefill chunk size
    start_step: int = 0  # the step it joins
    pos: int = 0
    tokens: list[int] | None = None
    logits: list[np.ndarray] | None = None


def drive(runner: TorchRunner, seqs: list[Seq]) -> list[tuple[int, int]]:
    """Greedy-decode every sequence ``N_NEW`` tokens, all in shared steps: a sequence joins at
    its ``start_step``, prefills in ``chunk``-token pieces, then decodes one token a step.
    Returns each step's (prefill rows, decode rows)."""
    for s in seqs:
        s.tokens, s.logits, s.pos = [], [], 0
    shape: list[tuple[int, int]] = []
    step = 0
    while any(len(s.tokens or []) < N_NEW for s in seqs):
        rows, owners = [], []
        for s in seqs:
            assert s.tokens is not None
            if step < s.start_step or len(s.tokens) >= N_NEW:
                continue
            if s.pos < len(s.prompt):
                ids = tuple(s.prompt[s.pos:s.pos + s.chunk])
                sample = s.pos + len(ids) == len(s.prompt)
            else:
                ids, sample = (s.tokens[-1],), True
            rows.append(EngineRow(0, ids, s.pos, sample, s.table, lora_slot=s.lora_slot))
            owners.append(s)
        shape.append((sum(len(r.token_ids) > 1 for r in rows),
                       sum(len(r.token_ids) == 1 for r in rows)))
        logits = runner.forward(rows)
        k = 0
        for row, s in zip(rows, owners, strict=True):
            s.pos += len(row.token_ids)
            if row.sample:
                assert s.tokens is not None and s.logits is not None
                s.tokens.append(int(logits[k].argmax()))
                s.logits.append(logits[k])
                k += 1
        assert k == len(logits)
        step += 1
    return shape


def check(seq: Seq, ref: tuple[list[int], np.ndarray], label: str) -> None:
    ref_tokens, ref_logits = ref
    assert seq.tokens == ref_tokens, label
    assert seq.logits is not None
    for k, step_logits in enumerate(seq.logits):  # the prefill's last position, then each decode
        np.testing.assert_allclose(step_logits, ref_logits[len(seq.prompt) - 1 + k],
                                   atol=ATOL, rtol=0, err_msg=f"{label}: token {k}")


def prompts(path: Path) -> list[list[int]]:
    tok = load_checkpoint(path).tokenizer
    return [tok.encode(t) for t in ("Once upon a time there was a robot who",
                                    "def add(a, b): return a + b  # and then",
                                    "What is the capital of France? It is")]


# -- the step's mask --------------------------------------------------------------------------


def test_mask_puts_each_tokens_scaling_on_its_slot_columns() -> None:
    scales = LoraScales(np.array([0.5, 2.0, 0.0], np.float32), 2, torch.float32)
    rows = [EngineRow(0, (1, 2, 3), 0, True, (0,), lora_slot=1),
            EngineRow(1, (4,), 5, True, (1,), lora_slot=-1),
            EngineRow(2, (5, 6), 0, False, (2,), lora_slot=0)]
    batch = build_step_batch(rows, BLOCK, 9, lora=scales)
    mask = batch.lora_mask
    assert mask is not None and mask.dtype == torch.float32
    expected = np.zeros((8, 6), np.float32)  # 6 tokens + 2 padding, S*R = 6
    expected[0:3, 2:4] = 2.0
    expected[4:6, 0:2] = 0.5
    np.testing.assert_array_equal(mask.numpy(), expected)
    assert batch.forward_args()[-1] is mask
    assert build_step_batch(rows, BLOCK, 9).lora_mask is None  # no LoRA: no mask, same args
    assert len(build_step_batch(rows, BLOCK, 9).forward_args()) == 8
    bf16 = LoraScales(scales.scaling, 2, torch.bfloat16)
    assert build_step_batch(rows, BLOCK, 9, lora=bf16).lora_mask.dtype == torch.bfloat16  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="row 0: lora_slot 3 outside"):
        build_step_batch([EngineRow(0, (1,), 0, True, (0,), lora_slot=3)], BLOCK, 9, lora=scales)


# -- greedy output against the oracles ---------------------------------------------------------


@pytest.mark.parametrize("name", list(MODELS))
def test_each_adapter_alone_matches_its_merged_weights(root: Path, tmp_path: Path,
                                                        name: str) -> None:
    base = model(root, name)
    arch = load_checkpoint(base).config
    spec = LoraSpec(max_loras=2, max_lora_rank=8)
    runner = make_runner(base, tmp_path, spec)
    adapters = [random_adapter(arch, "one", rank=8, alpha=16, seed=1),
                # rank 4 in rank-8 slots (zero padding), attention targets only, one layer
                random_adapter(arch, "two", rank=4, alpha=4, seed=2, targets=ATTN, layers=[1])]
    for slot, adapter in enumerate(adapters):
        runner.set_lora(slot, adapter)
    prompt = prompts(base)[0]
    base_ref = reference(base, prompt)
    for slot, adapter in [(-1, None), (0, adapters[0]), (1, adapters[1])]:
        path = base if adapter is None else merged_checkpoint(base, adapter,
                                                              root / f"{name}-{adapter.name}")
        ref = reference(path, prompt)
        seq = Seq(prompt, slot, tuple(range(8)), chunk=len(prompt))
        drive(runner, [seq])
        check(seq, ref, f"{name} slot {slot}")
        if adapter is not None:
            assert ref[0] != base_ref[0], "the adapter does not change the greedy output"


def test_mixed_steps_of_base_and_two_adapters_equal_each_alone(root: Path,
                                                               tmp_path: Path) -> None:
    base = model(root, "gqa8x2")
    arch = load_checkpoint(base).config
    runner = make_runner(base, tmp_path, LoraSpec(max_loras=3, max_lora_rank=8))
    one = random_adapter(arch, "one", rank=8, alpha=16, seed=1)
    two = random_adapter(arch, "two", rank=4, alpha=4, seed=2, targets=ATTN, layers=[1])
    # slot 0 stays empty: its rows would be the base model's
    runner.set_lora(2, one)
    runner.set_lora(1, two)
    p = prompts(base)
    refs = [reference(base, p[0]),
            reference(merged_checkpoint(base, one, root / "gqa8x2-one"), p[1]),
            reference(merged_checkpoint(base, two, root / "gqa8x2-two"), p[2]),
            reference(merged_checkpoint(base, one, root / "gqa8x2-one"), p[0])]
    seqs = [Seq(p[0], -1, tuple(range(0, 8)), chunk=5),
            Seq(p[1], 2, tuple(range(8, 16)), chunk=4, start_step=1),
            Seq(p[2], 1, tuple(range(16, 24)), chunk=7, start_step=3),
            Seq(p[0], 2, tuple(range(24, 32)), chunk=3, start_step=2)]  # prompt 0 through one
    shape = drive(runner, seqs)
    assert any(pre and dec for pre, dec in shape), "no step mixed prefill chunks and decodes"
    assert any(pre >= 2 for pre, _ in shape), "no step had two prefill chunks"
    for k, (seq, ref) in enumerate(zip(seqs, refs, strict=True)):
        check(seq, ref, f"sequence {k}")


# -- slots ---------------------------------------------------------------------------------


def test_set_lora_writes_in_place_and_none_clears(root: Path, tmp_path: Path) -> None:
    base = model(root, "gqa8x2")
    arch = load_checkpoint(base).config
    runner = make_runner(base, tmp_path, LoraSpec(max_loras=2, max_lora_rank=8))
    storage = [t.data_ptr() for t in runner.model.lora_weights]
    one = random_adapter(arch, "one", rank=8, alpha=16, seed=1)
    prompt = prompts(base)[1]
    runner.set_lora(1, one)
    a_all, b_all = runner.model.lora_slots[(0, "v_proj")]
    a, b = one.weights[(0, "v_proj")]
    np.testing.assert_array_equal(a_all[:, 8:16].numpy(), a)
    np.testing.assert_array_equal(b_all[8:16].numpy(), b)
    assert not a_all[:, :8].any() and not b_all[:8].any()  # the other slot untouched
    seq = Seq(prompt, 1, tuple(range(8)), chunk=len(prompt))
    drive(runner, [seq])
    check(seq, reference(merged_checkpoint(base, one, root / "gqa8x2-one"), prompt), "one")
    runner.set_lora(1, None)  # cleared: the slot's rows are the base model's
    assert not any(t.any() for t in runner.model.lora_weights)
    drive(runner, [seq])
    check(seq, reference(base, prompt), "cleared")
    # a smaller adapter replacing a larger one leaves nothing of it behind
    two = random_adapter(arch, "two", rank=4, alpha=4, seed=2, targets=ATTN, layers=[1])
    runner.set_lora(1, one)
    runner.set_lora(1, two)
    assert not runner.model.lora_slots[(0, "v_proj")][0].any()
    drive(runner, [seq])
    check(seq, reference(merged_checkpoint(base, two, root / "gqa8x2-two"), prompt), "two")
    assert [t.data_ptr() for t in runner.model.lora_weights] == storage


def test_set_lora_refuses_what_does_not_fit(root: Path, tmp_path: Path) -> None:
    base = model(root, "gqa8x2")
    arch = load_checkpoint(base).config
    runner = make_runner(base, tmp_path, LoraSpec(max_loras=2, max_lora_rank=4, targets=ATTN))
    with pytest.raises(ValueError, match=r"slot 2 outside \[0, 2\)"):
        runner.set_lora(2, None)
    with pytest.raises(ValueError, match="rank 8 > max_lora_rank 4"):
        runner.set_lora(0, random_adapter(arch, "big", rank=8, alpha=8, seed=1, targets=ATTN))
    with pytest.raises(ValueError, match="trains down_proj of layer 0"):
        runner.set_lora(0, random_adapter(arch, "mlp", rank=4, alpha=8, seed=1))
    bad = random_adapter(arch, "bad", rank=4, alpha=8, seed=1, targets=("q_proj",), layers=[0])
    a, b = bad.weights[(0, "q_proj")]
    wrong = LoraAdapter("bad", bad.path, 4, 2.0, {(0, "q_proj"): (a[:-1], b)})
    with pytest.raises(ValueError, match="layer 0 q_proj: A"):
        runner.set_lora(0, wrong)
    assert runner._lora is not None and not runner._lora.scaling.any()  # slots left empty
    assert not any(t.any() for t in runner.model.lora_weights)
    plain = make_runner(base, tmp_path, None)
    with pytest.raises(ValueError, match="built without LoRA"):
        plain.set_lora(0, None)


def test_without_lora_the_engine_is_todays(root: Path, tmp_path: Path) -> None:
    from inferflow.runtimes.torch_engine.engine_dir import engine_fields

    base = model(root, "gqa8x2")
    plain = make_runner(base, tmp_path, None)
    assert plain.lora_spec is None and plain.model.lora_weights == [] and plain._lora is None
    assert plain._step is plain._forward  # no wrapper, no extra arguments
    assert not any(k.startswith("lora") for k in plain.engine_dir.fields)
    with_lora = make_runner(base, tmp_path, LoraSpec(2, 8))
    assert with_lora.engine_dir.path != plain.engine_dir.path  # a key of its own
    assert engine_fields(load_checkpoint(base), plain.settings, plain.device) \
        == plain.engine_dir.fields


def test_moe_layers_refuse_mlp_targets(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).parent.parent / "engine"))
    from hf_checkpoints import save_hf_checkpoint

    path = save_hf_checkpoint(tmp_path / "mixtral", "MixtralForCausalLM", seed=11,
                              num_local_experts=4, num_experts_per_tok=2)
    with pytest.raises(ValueError, match=r"lora.target_modules: down_proj, gate_proj, up_proj on "
                                         "the mixture-of-experts layers"):
        make_runner(path, tmp_path, LoraSpec(2, 8))
    runner = make_runner(path, tmp_path, LoraSpec(2, 8, targets=ATTN))  # attention: served
    assert len(runner.model.lora_slots) == 4 * runner.model_config.num_layers


# -- Inductor ------------------------------------------------------------------------------


def test_inductor_engine_mixes_adapters_and_set_lora_needs_no_recompile(
        root: Path, tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    base = model(root, "gqa8x2")
    arch = load_checkpoint(base).config
    runner = make_runner(base, tmp_path, LoraSpec(max_loras=2, max_lora_rank=8),
                         compile="inductor")
    one = random_adapter(arch, "one", rank=8, alpha=16, seed=1)
    two = random_adapter(arch, "two", rank=4, alpha=4, seed=2, targets=ATTN, layers=[1])
    compiled = counters["stats"]["unique_graphs"]
    runner.set_lora(0, one)
    runner.set_lora(1, two)
    p = prompts(base)
    seqs = [Seq(p[0], 0, tuple(range(0, 8)), chunk=6),
            Seq(p[1], -1, tuple(range(8, 16)), chunk=5, start_step=1),
            Seq(p[2], 1, tuple(range(16, 24)), chunk=len(p[2]), start_step=2)]
    drive(runner, seqs)
    refs = [reference(merged_checkpoint(base, one, root / "gqa8x2-one"), p[0]),
            reference(base, p[1]),
            reference(merged_checkpoint(base, two, root / "gqa8x2-two"), p[2])]
    for k, (seq, ref) in enumerate(zip(seqs, refs, strict=True)):
        check(seq, ref, f"inductor sequence {k}")
    assert counters["stats"]["unique_graphs"] == compiled, "a step or set_lora recompiled"
