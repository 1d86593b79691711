"""Factories for engine tests: seeded checkpoints (cached per session) and small engines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from inferflow import LLM
from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.checkpoint import load_checkpoint
from inferflow.models.tiny import TinySpec, make_checkpoint
from inferflow.runtimes.config import OrtSettings
from inferflow.runtimes.onnxruntime_paged import PagedOnnxRuntimeRunner
from inferflow.runtimes.onnxruntime_runner import OnnxRuntimeRunner, OrtEngine
from inferflow.runtimes.ort_ops.build import op_status as paged_op_status
from inferflow.runtimes.step_inputs import EngineRow

PROMPTS = ["Hello, world! The moon", "def add(a, b):", "Once upon a time there was a robot",
           "What is the capital of France?"]

# name -> (make_checkpoint kwargs). "gqa8x2" is the Llama-3-like default: 8 query / 2 KV heads,
# rope_theta 500000 with llama3 rope scaling, untied embeddings.
CHECKPOINTS: dict[str, dict[str, object]] = {
    "gqa8x2": {},
    "tied": {"tie_word_embeddings": True},
    "bf16": {"dtype": "bfloat16"},
    "fp16_sharded": {"dtype": "float16", "shards": 3},
    "plain_rope": {"llama3_rope_scaling": False, "rope_theta": 10000.0, "num_kv_heads": 8},
    "qwen2_bias": {"architecture": "Qwen2ForCausalLM", "attention_bias": True},
    "mistral": {"architecture": "MistralForCausalLM", "num_kv_heads": 4},
    # a 4 KiB fp32 intermediate row: the CPU form pads the MLP to 1,056 columns (llama_graph)
    "ffn1024": {"intermediate_size": 1024},
}


def make_named_checkpoint(root: Path, name: str) -> Path:
    kwargs = dict(CHECKPOINTS[name])
    dtype = str(kwargs.pop("dtype", "float32"))
    shards = int(kwargs.pop("shards", 1))  # type: ignore[call-overload]
    path = root / name
    if not (path / "tokenizer.json").exists():
        make_checkpoint(path, TinySpec(**kwargs), seed=1, dtype=dtype, shards=shards)  # type: ignore[arg-type]
    return path


def transformers_reference(path: Path, prompt: list[int], n_new: int,
                           dtype: object = None) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens after ``prompt`` and the float32 logits of every position
    (prompt and generated): the oracle the engines are checked against."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
        full = out[0].tolist()
        logits = model(torch.tensor([full])).logits[0].float().numpy()
    return full[len(prompt):], logits


# the graph forms an ONNX Runtime engine test runs on: the paged pool where the op builds here
# (skipped with the reason elsewhere), and the slot forms
ORT_FORMS = [pytest.param("paged", marks=pytest.mark.skipif(
    not paged_op_status()[0], reason=f"paged-attention op: {paged_op_status()[1]}")), "gqa"]


def make_engine(path: Path, *, max_slots: int = 4, max_model_len: int = 256, block_size: int = 16,
                num_blocks: int = 0, **settings: object) -> OrtEngine:
    """A runner over ``KVLayout.plan(max_slots, max_model_len, block_size, num_blocks)``;
    ``settings``: ``OrtSettings`` fields (``graph_form="paged"``: the paged pool, ``slot_tables``
    giving each slot's rows their blocks, scattered over the pool)."""
    from inferflow.scheduling.layout import KVLayout

    paged = settings.get("graph_form") == "paged"
    layout = KVLayout.plan(max_slots, max_model_len, block_size, num_blocks, paged=paged)
    runner_class = PagedOnnxRuntimeRunner if paged else OnnxRuntimeRunner
    return runner_class(load_checkpoint(path), OrtSettings(**settings), layout)  # type: ignore[arg-type]


def slot_table(engine: object, slot: int) -> tuple[int, ...]:
    """Slot ``slot``'s block table on a paged engine (every slot its own blocks, in a seeded
    random order over the pool, so neighbouring positions live in scattered blocks); () on
    slots."""
    if not isinstance(engine, PagedOnnxRuntimeRunner):
        return ()
    layout = engine.layout
    per_slot = -(-layout.max_model_len // layout.block_size)
    order = np.random.default_rng(7).permutation(layout.num_blocks)
    return tuple(int(b) for b in order[slot * per_slot:(slot + 1) * per_slot])


def greedy(engine: OrtEngine, prompt: list[int], n: int, slot: int = 0) -> tuple[list[int], list]:
    """Greedy decode with one prefill call then one decode call per token; returns tokens, logits."""
    table = slot_table(engine, slot)
    logits = engine.forward([EngineRow(slot, tuple(prompt), 0, True, table)])[0]
    tokens, all_logits, pos = [], [logits], len(prompt)
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = engine.forward([EngineRow(slot, (tokens[-1],), pos, True, table)])[0]
        all_logits.append(logits)
        pos += 1
    return tokens, all_logits


def make_torch_engine(path: Path, *, num_blocks: int = 64, max_num_seqs: int = 4,
                      max_model_len: int = 256, block_size: int = 8, prefix: bool = True,
                      compile: str = "eager", dtype: str = "float32",
                      max_num_batched_tokens: int = 48, cache_dir: Path | None = None) -> LLMEngine:
    """An ``LLMEngine`` over ``executor=torch`` (paged KV, ``num_blocks`` physical blocks)."""
    from inferflow.scheduling.config import SchedulerConfig
    from inferflow.scheduling.kv_cache_manager import KVCacheManager
    from inferflow.scheduling.layout import KVLayout
    from inferflow.scheduling.scheduler import Scheduler
    from inferflow.stages.detokenizer import StreamingDetokenizer
    from inferflow.stages.torch_executor import TorchExecutor

    checkpoint = load_checkpoint(path)
    layout = KVLayout(max_num_seqs, max_model_len, block_size, num_blocks, paged=True)
    executor = TorchExecutor(compile=compile, dtype=dtype,  # type: ignore[arg-type]
                             cache_dir=str(cache_dir) if cache_dir else None)
    executor.load(checkpoint, layout)
    budgets = SchedulerConfig(max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens)
    kv = KVCacheManager(layout.num_blocks, layout.block_size, prefix)
    return LLMEngine(checkpoint, executor, Scheduler(budgets, layout, kv=kv),
                     StreamingDetokenizer())


def torch_greedy(runner: object, prompt: list[int], n: int,
                 table: tuple[int, ...]) -> tuple[list[int], list]:
    """``greedy`` on a paged ``TorchRunner``: the sequence's KV in the blocks of ``table``."""
    forward = runner.forward  # type: ignore[attr-defined]
    logits = forward([EngineRow(0, tuple(prompt), 0, True, table)])[0]
    tokens, all_logits, pos = [], [logits], len(prompt)
    for _ in range(n):
        tokens.append(int(logits.argmax()))
        logits = forward([EngineRow(0, (tokens[-1],), pos, True, table)])[0]
        all_logits.append(logits)
        pos += 1
    return tokens, all_logits


def run_greedy(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, together: bool,
               after_each: Callable[[LLMEngine], None] | None = None) -> list[list[int]]:
    """Greedy outputs of ``prompts`` (``ignore_eos``), all queued at once (``together``) or one
    after the other, ``after_each(engine)`` running after each one finished."""
    from inferflow.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    done: dict[str, list[int]] = {}

    def drain() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids

    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        if not together:
            drain()
            if after_each is not None:
                after_each(engine)
    drain()
    return [done[str(i)] for i in range(len(prompts))]


def llm_on(path: Path, executor: str, max_slots: int = 4, num_blocks: int = 64,
           **kw: object) -> LLM:
    """An offline ``LLM`` on ``executor``: ``"torch"`` (paged KV, eager, ``num_blocks``), ONNX
    Runtime's paged pool (``"paged"``, ``num_blocks``) or its slots in graph form ``"gqa"`` or
    ``"canonical"`` (``max_slots``); ``kw``: ``LLM`` keywords."""
    if executor == "paged":
        return LLM(path, max_slots=max_slots, graph_form="paged", num_blocks=num_blocks, **kw)
    if executor == "torch":
        return LLM(path, backend="torch", compile="eager", num_blocks=num_blocks, **kw)
    return LLM(path, max_slots=max_slots, graph_form=executor, **kw)
