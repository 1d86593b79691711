"""Every family ``models/families/`` serves gives transformers' output, in every executor.

Each case is a tiny checkpoint written by transformers' own ``save_pretrained`` (every parameter
seeded; ``hf_checkpoints.py``), served by the ONNX Runtime engine (the CPU form and the
canonical form TensorRT parses) and the torch executor, and compared with transformers'
``generate`` on a 320-token prompt plus 12 greedy tokens: the tokens equal, the fp32 logits
within ``ATOL``. Windowed cases have windows of 64 tokens, so prefill and decode both attend
through them; ``test_chunked_prefill_across_the_window`` feeds the prompt in chunks that cross
window boundaries. Quantized and 16-bit engines are held to a top-1 agreement with transformers
over a few hundred teacher-forced positions (``test_precisions_agree``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_factories import (
    ORT_FORMS,
    greedy,
    make_engine,
    slot_table,
    torch_greedy,
    transformers_reference,
)
from hf_checkpoints import long_prompt, save_hf_checkpoint

from inferflow.models.checkpoint import load_checkpoint
from inferflow.runtimes.step_inputs import EngineRow
from inferflow.scheduling.layout import KVLayout, kv_window

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from inferflow.runtimes.config import TorchSettings  # noqa: E402
from inferflow.runtimes.torch_engine.runner import TorchRunner  # noqa: E402

pytestmark = pytest.mark.slow  # transformers builds and runs every case

PROMPT_TOKENS, N_NEW, CONTEXT, WINDOW = 320, 12, 512, 64
ATOL = 1e-3  # fp32 logits: the kernels' round-off, not a different computation

_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 48}
_GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": WINDOW,
          "tie_word_embeddings": True}

# name -> (architecture, config class arguments beyond hf_checkpoints.BASE)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),  # != hidden_size / heads (16)
    "qwen3_window": ("Qwen3ForCausalLM", {"head_dim": 16, "use_sliding_window": True,
                                          "sliding_window": WINDOW, "max_window_layers": 1}),
    "gemma2": ("Gemma2ForCausalLM", _GEMMA),  # soft-capping 50 / 30, local + global layers
    "gemma3": ("Gemma3ForCausalLM", {**_GEMMA, "num_hidden_layers": 6, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    "phi3": ("Phi3ForCausalLM", {}),
    "phi4_partial_rotary": ("Phi3ForCausalLM", {"sliding_window": WINDOW, "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}}),
    # longrope (Phi-4-mini), served up to original_max_position_embeddings (= the context here)
    "phi4_longrope": ("Phi3ForCausalLM", {"max_position_embeddings": 8192, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 1e4, "partial_rotary_factor": 0.75,
        "original_max_position_embeddings": CONTEXT, "short_factor": [1 + i / 8 for i in range(6)],
        "long_factor": [4.0] * 6}}),
    "mistral_window": ("MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen2_window": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": WINDOW,
                                          "max_window_layers": 1}),
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", {**_MOE, "num_experts": 8}),
    "qwen3_moe_norm_topk": ("Qwen3MoeForCausalLM", {**_MOE, "num_experts": 8, "norm_topk_prob": True,
                                                    "mlp_only_layers": [1]}),
    "qwen2_moe_shared": ("Qwen2MoeForCausalLM", {**_MOE, "num_experts": 4,
                                                 "shared_expert_intermediate_size": 96}),
}
WINDOWED = [name for name, (_, cfg) in CASES.items() if cfg.get("sliding_window")]
EXECUTORS = [*ORT_FORMS, "canonical", "torch"]


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def checkpoint(root: Path, name: str, config_format: str = "v5") -> Path:
    architecture, config = CASES[name]
    return save_hf_checkpoint(root / f"{name}-{config_format}", architecture, seed=11,
                              config_format=config_format, **config)


_REFERENCES: dict[str, tuple[list[int], list[int], np.ndarray]] = {}


def reference(root: Path, name: str) -> tuple[list[int], list[int], np.ndarray]:
    """(prompt, transformers' greedy tokens, its logits at every position), once per case."""
    if name not in _REFERENCES:
        path = checkpoint(root, name)
        prompt = long_prompt(load_checkpoint(path).tokenizer, PROMPT_TOKENS)
        _REFERENCES[name] = (prompt, *transformers_reference(path, prompt, N_NEW))
    return _REFERENCES[name]


def torch_runner(path: Path, tmp_path: Path, dtype: str = "float32") -> TorchRunner:
    layout = KVLayout(2, CONTEXT, 16, CONTEXT // 16 + 2, paged=True)
    settings = TorchSettings(compile="eager", cache_dir=str(tmp_path), dtype=dtype)
    return TorchRunner(load_checkpoint(path), settings, layout)


TABLE = tuple(range(CONTEXT // 16))


def run_engine(path: Path, executor: str, prompt: list[int], tmp_path: Path) -> tuple[list[int], list]:
    if executor == "torch":
        return torch_greedy(torch_runner(path, tmp_path), prompt, N_NEW, TABLE)
    engine = make_engine(path, graph_form=executor, max_slots=1, max_model_len=CONTEXT,
                         cache_dir=str(tmp_path))
    return greedy(engine, prompt, N_NEW)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logits_match_transformers(
    ckpt_root: Path, tmp_path: Path, name: str, executor: str
) -> None:
    path = checkpoint(ckpt_root, name)
    prompt, ref_tokens, ref_logits = reference(ckpt_root, name)
    tokens, logits = run_engine(path, executor, prompt, tmp_path)
    assert tokens == ref_tokens, f"{name}/{executor}"
    for k, step_logits in enumerate(logits[:N_NEW]):  # the prefill's last position, then each decode
        np.testing.assert_allclose(step_logits, ref_logits[len(prompt) - 1 + k], atol=ATOL, rtol=0,
                                   err_msg=f"{name}/{executor} step {k}")


def _chunked_logits(forward: Any, prompt: list[int], chunk: int, table: tuple[int, ...] = ()) -> list:
    """The last position's logits after feeding ``prompt`` ``chunk`` tokens per step."""
    logits = None
    for start in range(0, len(prompt), chunk):
        piece = tuple(prompt[start:start + chunk])
        row = EngineRow(0, piece, start, True, table) if table else EngineRow(0, piece, start, True)
        logits = forward([row])[0]
    return logits  # type: ignore[return-value]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("name", WINDOWED)
def test_chunked_prefill_across_the_window(
    ckpt_root: Path, tmp_path: Path, name: str, executor: str
) -> None:
    """Chunks of 48 tokens (not a multiple of the 64-token window): each chunk's queries see
    keys of earlier chunks only inside their window."""
    path = checkpoint(ckpt_root, name)
    prompt, _, ref_logits = reference(ckpt_root, name)
    if executor == "torch":
        logits = _chunked_logits(torch_runner(path, tmp_path).forward, prompt, 48, TABLE)
    elif executor == "paged":
        logits = _paged_chunks_freeing_the_window(path, tmp_path, prompt, 48)
    else:
        engine = make_engine(path, graph_form=executor, max_slots=1, max_model_len=CONTEXT,
                             cache_dir=str(tmp_path))
        logits = _chunked_logits(engine.forward, prompt, 48)
    np.testing.assert_allclose(logits, ref_logits[len(prompt) - 1], atol=ATOL, rtol=0)


def _paged_chunks_freeing_the_window(path: Path, tmp_path: Path, prompt: list[int], chunk: int) -> Any:
    """``_chunked_logits`` on ONNX Runtime's paged pool, freeing blocks as the scheduler does
    under a window every layer has: after each chunk, a block no later query can see becomes the
    null block in the table and its memory is filled with NaN (the op must never read it)."""
    engine = make_engine(path, graph_form="paged", max_slots=1, max_model_len=CONTEXT,
                         cache_dir=str(tmp_path))
    window = kv_window(engine.model_config.layer_windows)
    bs = engine.layout.block_size
    table = list(slot_table(engine, 0))
    logits = None
    for start in range(0, len(prompt), chunk):
        piece = tuple(prompt[start:start + chunk])
        logits = engine.forward([EngineRow(0, piece, start, True, tuple(table))])[0]
        next_query = start + len(piece)
        for i, block in enumerate(table):
            if window is not None and block != engine.null_block and (i + 1) * bs - 1 <= next_query - window:
                for k, v in engine.pool:
                    k[block], v[block] = np.nan, np.nan
                table[i] = engine.null_block
    return logits


# top-1 agreement with transformers' fp32 argmax over the teacher-forced positions; bounds are
# what quantization of these tiny random models allows (the figures are printed and recorded)
PRECISIONS = {("ort", "fp16"): 0.95, ("ort", "int8"): 0.90, ("ort", "int4"): 0.60,
              ("torch", "bfloat16"): 0.85, ("torch", "float16"): 0.95}


@pytest.mark.parametrize("precision", list(PRECISIONS), ids=lambda p: "-".join(p))
@pytest.mark.parametrize("name", ["qwen3", "gemma3", "phi4_partial_rotary", "qwen3_moe", "mixtral",
                                  "qwen2_moe_shared"])
def test_precisions_agree(ckpt_root: Path, tmp_path: Path, name: str, precision: tuple[str, str],
                          record_property: pytest.RecordProperty) -> None:
    path = checkpoint(ckpt_root, name)
    prompt, ref_tokens, ref_logits = reference(ckpt_root, name)
    sequence = prompt + ref_tokens
    executor, dtype = precision
    if executor == "torch":
        runner = torch_runner(path, tmp_path, dtype)
        logits = runner.forward([EngineRow(0, tuple(sequence), 0, True, TABLE, num_logits=len(sequence))])
    else:
        engine = make_engine(path, precision=dtype, max_slots=1, max_model_len=CONTEXT,
                             cache_dir=str(tmp_path))
        logits = engine.forward([EngineRow(0, tuple(sequence), 0, True, num_logits=len(sequence))])
    top1 = np.asarray(logits).reshape(len(sequence), -1).argmax(-1)
    agreement = float((top1 == ref_logits.argmax(-1)).mean())
    record_property(f"{name}_{executor}_{dtype}_top1", agreement)
    print(f"{name} {executor} {dtype}: top-1 agreement {agreement:.1%} over {len(sequence)} positions")
    assert agreement >= PRECISIONS[precision]


@pytest.mark.parametrize("name", list(CASES))
def test_both_config_formats_read_the_same_architecture(ckpt_root: Path, name: str) -> None:
    """transformers 4's spelling (``rope_theta``/``rope_scaling``, Gemma 3's
    ``rope_local_base_freq``, a top-level ``partial_rotary_factor``) parses as today's does."""
    v5 = load_checkpoint(checkpoint(ckpt_root, name)).config
    assert load_checkpoint(checkpoint(ckpt_root, name, "legacy")).config == v5


def test_what_each_family_reads(ckpt_root: Path) -> None:
    gemma3 = load_checkpoint(checkpoint(ckpt_root, "gemma3")).config
    assert gemma3.layer_windows == (WINDOW,) * 5 + (None,)
    assert (gemma3.rope.theta, gemma3.local_rope and gemma3.local_rope.theta) == (1e6, 1e4)
    assert gemma3.block.norm_offset == 1.0 and gemma3.block.qk_norm and gemma3.block.sandwich_norms
    assert gemma3.block.attn_scale == pytest.approx(24 ** -0.5)
    gemma2 = load_checkpoint(checkpoint(ckpt_root, "gemma2")).config
    assert (gemma2.block.attn_softcap, gemma2.block.final_softcap) == (50.0, 30.0)
    assert gemma2.layer_windows == (WINDOW, None)
    phi4 = load_checkpoint(checkpoint(ckpt_root, "phi4_partial_rotary")).config
    assert (phi4.rotary_dim, phi4.head_dim) == (12, 16)
    moe = load_checkpoint(checkpoint(ckpt_root, "qwen3_moe_norm_topk")).config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (8, 2, True)
    assert moe.sparse_layers == (True, False)
    shared = load_checkpoint(checkpoint(ckpt_root, "qwen2_moe_shared")).config.moe
    assert shared is not None and shared.shared_intermediate_size == 96


def test_layer_types_win_over_the_window_pattern(ckpt_root: Path, tmp_path: Path) -> None:
    """Gemma 3 files carry ``_sliding_window_pattern`` beside ``layer_types``; they can disagree
    and ``layer_types`` is what transformers uses."""
    import shutil

    path = tmp_path / "gemma3"
    shutil.copytree(checkpoint(ckpt_root, "gemma3"), path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["_sliding_window_pattern"] = 2
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(path).config.layer_windows == (WINDOW,) * 5 + (None,)
    del cfg["layer_types"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert load_checkpoint(path).config.layer_windows == (WINDOW, None) * 3


def test_expert_count_in_both_spellings(ckpt_root: Path, tmp_path: Path) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as ``num_local_experts``; hub files say
    ``num_experts``."""
    import shutil

    path = tmp_path / "moe"
    shutil.copytree(checkpoint(ckpt_root, "qwen3_moe"), path)
    cfg = json.loads((path / "config.json").read_text())
    assert "num_local_experts" in cfg
    cfg["num_experts"] = cfg.pop("num_local_experts")
    (path / "config.json").write_text(json.dumps(cfg))
    moe = load_checkpoint(path).config.moe
    assert moe is not None and moe.num_experts == 8


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe_shared"])
def test_parameter_counts_of_a_mixture(ckpt_root: Path, name: str) -> None:
    """``num_parameters`` counts every tensor the checkpoint holds; ``active_parameters`` leaves
    out the experts a token does not use (num_experts - top_k per sparse layer)."""
    from inferflow.models.checkpoint import expected_shapes

    cfg = load_checkpoint(checkpoint(ckpt_root, name)).config
    assert cfg.moe is not None
    stored = sum(int(np.prod(shape)) for shape in expected_shapes(cfg).values())
    assert cfg.num_parameters == stored
    unused = (cfg.moe.num_experts - cfg.moe.top_k) * 3 * cfg.hidden_size * cfg.moe.intermediate_size
    assert cfg.active_parameters == stored - unused * sum(cfg.moe.sparse_layers)
