"""Checkpoints saved by today's transformers (``save_pretrained``), in both config.json formats,
give transformers' greedy tokens, with logits within 1e-3 (fp32), on prompts of 320 tokens: on
ONNX Runtime (the CPU form and the canonical form TensorRT parses) and on the torch executor
(on the CPU, and on a CUDA GPU where there is one; the reference runs on the CPU).

One case per config field that changes the math: θ ≠ 10,000, each rope type, the MLP
activations, Llama's attention and MLP biases, an explicit ``head_dim``, tied embeddings,
Qwen2's q/k/v biases, Mistral with a window no shorter than the context. What inferflow does not
compute is refused in one line naming the field (``test_checkpoint_errors.py``, and the
command line's exit code 2 in ``tests/config/test_checkpoint_cli.py``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from engine_factories import ORT_FORMS, greedy, make_engine, torch_greedy, transformers_reference
from hf_checkpoints import long_prompt, save_hf_checkpoint

from inferflow.models.checkpoint import load_checkpoint
from inferflow.scheduling.layout import KVLayout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from inferflow.runtimes.config import TorchSettings  # noqa: E402
from inferflow.runtimes.torch_engine.runner import TorchRunner  # noqa: E402

PROMPT_TOKENS, N_NEW, CONTEXT = 320, 12, 512
ATOL = 1e-3  # fp32 logits: the kernels' round-off, not a different computation


def _rope(rope_type: str, **params: Any) -> dict[str, Any]:
    return {"rope_parameters": {"rope_type": rope_type, **params}}


# name -> (architecture, config class arguments). Scaled rope types have their pre-training
# context (original_max_position_embeddings) inside the prompt, so scaling is exercised.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "theta_1e6": ("LlamaForCausalLM", _rope("default", rope_theta=1e6)),
    "linear": ("LlamaForCausalLM", _rope("linear", factor=4.0, rope_theta=5e5)),
    "dynamic": ("LlamaForCausalLM", _rope("dynamic", factor=2.0, rope_theta=1e5)),
    "yarn": ("LlamaForCausalLM", _rope("yarn", factor=4.0, rope_theta=1e5,
                                       original_max_position_embeddings=256)),
    "yarn_explicit": ("LlamaForCausalLM", _rope(
        "yarn", factor=8.0, rope_theta=1e4, original_max_position_embeddings=128,
        attention_factor=0.9, beta_fast=16.0, beta_slow=2.0, truncate=False)),
    "llama3": ("LlamaForCausalLM", _rope("llama3", factor=8.0, rope_theta=5e5, low_freq_factor=1.0,
                                         high_freq_factor=4.0, original_max_position_embeddings=256)),
    "gelu": ("LlamaForCausalLM", {"hidden_act": "gelu"}),
    "gelu_tanh": ("LlamaForCausalLM", {"hidden_act": "gelu_pytorch_tanh"}),
    "relu": ("LlamaForCausalLM", {"hidden_act": "relu"}),
    "llama_biases": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "head_dim": ("LlamaForCausalLM", {"head_dim": 32}),  # != hidden_size / heads (16)
    "tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "qwen2": ("Qwen2ForCausalLM", _rope("default", rope_theta=1e6)),
    "mistral_window": ("MistralForCausalLM", {"sliding_window": 4096}),
}
FORMATS = ("v5", "legacy")


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_saved")


@pytest.fixture(scope="module")
def reference() -> Any:
    """(case name) -> the prompt, transformers' greedy tokens and logits of every position; the
    weights are the same in both formats, so one reference serves both."""
    cache: dict[str, tuple[list[int], list[int], np.ndarray]] = {}

    def get(root: Path, name: str) -> tuple[list[int], list[int], np.ndarray]:
        if name not in cache:
            path = checkpoint(root, name, "v5")
            prompt = long_prompt(load_checkpoint(path).tokenizer, PROMPT_TOKENS)
            cache[name] = (prompt, *transformers_reference(path, prompt, N_NEW))
        return cache[name]

    return get


def checkpoint(root: Path, name: str, config_format: str) -> Path:
    architecture, config = CASES[name]
    return save_hf_checkpoint(root / f"{name}-{config_format}", architecture, seed=7,
                              config_format=config_format, **config)


def run_engine(path: Path, executor: str, prompt: list[int], tmp_path: Path) -> tuple[list[int], list]:
    if executor.startswith("torch"):  # torch (CPU) or torch_cuda
        layout = KVLayout(2, CONTEXT, 16, CONTEXT // 16 + 2, paged=True)
        settings = TorchSettings(compile="eager", cache_dir=str(tmp_path),
                                 device="cuda" if executor == "torch_cuda" else "cpu")
        runner = TorchRunner(load_checkpoint(path), settings, layout)
        return torch_greedy(runner, prompt, N_NEW, tuple(range(CONTEXT // 16)))
    engine = make_engine(path, graph_form=executor, max_slots=1, max_model_len=CONTEXT)
    return greedy(engine, prompt, N_NEW)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.slow
@pytest.mark.parametrize("executor", [*ORT_FORMS, "canonical", "torch", pytest.param("torch_cuda", marks=CUDA)])
@pytest.mark.parametrize("config_format", FORMATS)
@pytest.mark.parametrize("name", list(CASES))
def test_greedy_tokens_and_logits_match_transformers(
    ckpt_root: Path, reference: Any, tmp_path: Path, name: str, config_format: str, executor: str
) -> None:
    path = checkpoint(ckpt_root, name, config_format)
    prompt, ref_tokens, ref_logits = reference(ckpt_root, name)
    tokens, logits = run_engine(path, executor, prompt, tmp_path)
    assert tokens == ref_tokens, f"{name}/{config_format}/{executor}"
    for k, step_logits in enumerate(logits[:N_NEW]):  # the prefill's last position, then each decode
        np.testing.assert_allclose(step_logits, ref_logits[len(prompt) - 1 + k], atol=ATOL, rtol=0,
                                   err_msg=f"{name}/{config_format}/{executor} step {k}")


@pytest.mark.slow  # transformers builds each architecture
@pytest.mark.parametrize("config_format", FORMATS)
def test_both_formats_read_the_same_architecture(ckpt_root: Path, config_format: str) -> None:
    """The saved files are what the cases claim, and both spellings parse to the same thing."""
    raw = json.loads((checkpoint(ckpt_root, "yarn", config_format) / "config.json").read_text())
    assert ("rope_parameters" in raw) == (config_format == "v5")
    assert ("rope_scaling" in raw) == (config_format == "legacy")
    for name in CASES:
        v5 = load_checkpoint(checkpoint(ckpt_root, name, "v5")).config
        assert load_checkpoint(checkpoint(ckpt_root, name, config_format)).config == v5
    yarn = load_checkpoint(checkpoint(ckpt_root, "yarn_explicit", config_format)).config.rope
    assert (yarn.rope_type, yarn.factor, yarn.attention_factor, yarn.truncate) == ("yarn", 8.0, 0.9, False)
    arch = load_checkpoint(checkpoint(ckpt_root, "llama_biases", config_format)).config
    assert arch.attention_bias and arch.o_proj_bias and arch.mlp_bias
