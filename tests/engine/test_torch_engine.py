"""The torch executor (``executor=torch``): paged KV, Inductor, checked against transformers.

Greedy output equals transformers token for token on every checkpoint variant the ONNX Runtime
engine is tested on; mixed prefill/decode batches equal each request alone; prefix hits share
physical blocks (block ids and refcounts, no copy) and change no output; preemption under a
tight block budget changes no output; concurrency follows free blocks, not ``max_model_len``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_factories import (
    CHECKPOINTS,
    PROMPTS,
    make_named_checkpoint,
    make_torch_engine,
    run_greedy,
    torch_greedy,
    transformers_reference,
)

from inferflow.engine.llm_engine import LLMEngine
from inferflow.models.checkpoint import load_checkpoint
from inferflow.sampling_params import SamplingParams
from inferflow.scheduling.layout import KVLayout

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from inferflow.runtimes.config import TorchSettings  # noqa: E402
from inferflow.runtimes.torch_engine.runner import TorchRunner  # noqa: E402
from inferflow.scheduling.integrity import check_scheduler  # noqa: E402

N_NEW = 24
SYSTEM = "System: You are a helpful assistant. Answer briefly and truthfully, please. " * 3


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torch_ckpts")


@pytest.fixture(scope="module")
def ckpt(ckpt_root: Path) -> Path:
    return make_named_checkpoint(ckpt_root, "gqa8x2")


def reference(path: Path, prompt: list[int], dtype: object = None) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and the logits of every position."""
    return transformers_reference(path, prompt, N_NEW, dtype)


def runner(path: Path, tmp_path: Path, compile: str = "eager", dtype: str = "float32",
           num_blocks: int = 16, block_size: int = 16) -> TorchRunner:
    layout = KVLayout(4, 256, block_size, num_blocks, paged=True)
    return TorchRunner(load_checkpoint(path), TorchSettings(compile=compile, dtype=dtype,
                                                            cache_dir=str(tmp_path)), layout)


@pytest.mark.parametrize(
    ("name", "compile"),
    [(name, "eager") for name in CHECKPOINTS]
    + [pytest.param("gqa8x2", "inductor", marks=pytest.mark.slow),  # Inductor compiles on CPU
       pytest.param("qwen2_bias", "inductor", marks=pytest.mark.slow)],
)
def test_greedy_tokens_and_logits_match_transformers(
    ckpt_root: Path, tmp_path: Path, name: str, compile: str
) -> None:
    path = make_named_checkpoint(ckpt_root, name)
    engine = runner(path, tmp_path, compile)
    tokenizer = load_checkpoint(path).tokenizer
    # a scattered block table: positions 0-15 in block 9, 16-31 in block 2, ...
    table = (9, 2, 14, 0, 7, 11, 5, 3)
    for prompt_text in PROMPTS[:3]:
        prompt = tokenizer.encode(prompt_text)
        ref_tokens, ref_logits = reference(path, prompt)
        tokens, logits = torch_greedy(engine, prompt, N_NEW, table)
        assert tokens == ref_tokens, f"{name}/{compile}: {prompt_text!r}"
        for k, step_logits in enumerate(logits[:N_NEW]):
            np.testing.assert_allclose(step_logits, ref_logits[len(prompt) - 1 + k],
                                       atol=1e-3, rtol=0)


def test_bfloat16_engine_tracks_transformers_in_bfloat16(ckpt: Path, tmp_path: Path) -> None:
    engine = runner(ckpt, tmp_path, dtype="bfloat16")
    prompt = load_checkpoint(ckpt).tokenizer.encode(PROMPTS[0])
    ref_tokens, ref_logits = reference(ckpt, prompt, torch.bfloat16)
    tokens, logits = torch_greedy(engine, prompt, N_NEW, tuple(range(8)))
    # bf16 rounding differs between kernels; the first tokens and the prefill logits agree
    assert tokens[:4] == ref_tokens[:4]
    np.testing.assert_allclose(logits[0], ref_logits[len(prompt) - 1], atol=0.1, rtol=0)


run = run_greedy


def test_mixed_prefill_and_decode_batches_equal_each_request_alone(ckpt: Path) -> None:
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(p * 2) for p in PROMPTS]
    alone = run(make_torch_engine(ckpt, prefix=False), prompts, 20, together=False)
    batched = make_torch_engine(ckpt, prefix=False)
    steps: list[tuple[int, int]] = []  # (prefill rows, decode rows) of each step
    batched.executor = _recording(batched.executor, steps)
    assert run(batched, prompts, 20, together=True) == alone
    assert any(p and d for p, d in steps), "no step mixed a prefill chunk with decodes"


def _recording(executor: object, steps: list[tuple[int, int]]) -> object:
    class Recording:
        def __getattr__(self, name: str) -> object:
            return getattr(executor, name)

        def execute(self, plan: object) -> object:
            chunks = plan.chunks  # type: ignore[attr-defined]
            assert not plan.kv_loads and not plan.kv_saves  # type: ignore[attr-defined]
            steps.append((sum(len(c.token_ids) > 1 for c in chunks),
                          sum(len(c.token_ids) == 1 for c in chunks)))
            return executor.execute(plan)  # type: ignore[attr-defined]

    return Recording()


def test_prefix_hits_share_physical_blocks_without_copies(ckpt: Path) -> None:
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(SYSTEM + q) for q in PROMPTS[:3]]
    shared_blocks = (len(tok.encode(SYSTEM)) - 1) // 8  # full 8-token blocks of the system prompt
    engine = make_torch_engine(ckpt, prefix=True)
    engine.executor = _recording(engine.executor, [])
    kv = engine.scheduler.kv
    tables: dict[str, list[int]] = {}
    refcounts: dict[str, list[int]] = {}

    def watch(e: LLMEngine) -> None:
        for r in e.scheduler.running:
            tables[r.request_id] = kv.block_ids(r.request_id)  # the latest: all its blocks
            refcounts.setdefault(r.request_id, [kv.pool.ref_cnt(b) for b in kv.block_ids(r.request_id)])

    # the first request runs alone; the next two arrive together once its blocks are cached
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engine.add_request("0", prompts[0], params)
    while engine.has_unfinished_requests():
        engine.step()
        watch(engine)
    for i in (1, 2):
        engine.add_request(str(i), prompts[i], params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        watch(engine)
    first = tables["0"][:shared_blocks]
    assert shared_blocks >= 4
    for rid in ("1", "2"):
        assert tables[rid][:shared_blocks] == first  # the very same physical blocks
    # while 1 and 2 ran together, each shared block had both of them as holders
    assert refcounts["2"][:shared_blocks] == [2] * shared_blocks
    assert engine.stats().prefix_cache_hits >= 2 * shared_blocks * 8
    plain = run(make_torch_engine(ckpt, prefix=False), prompts[1:], 12, together=True)
    assert [outputs["1"], outputs["2"]] == plain
    check_scheduler(engine.scheduler)


def test_preemption_under_a_tight_block_budget_gives_the_same_outputs(ckpt: Path) -> None:
    tok = load_checkpoint(ckpt).tokenizer
    prompts = [tok.encode(p * 3) for p in PROMPTS]
    roomy = run(make_torch_engine(ckpt, prefix=False, num_blocks=64), prompts, 40, together=True)
    tight = make_torch_engine(ckpt, prefix=False, num_blocks=20)
    assert run(tight, prompts, 40, together=True) == roomy
    assert tight.stats().num_preemptions > 0
    check_scheduler(tight.scheduler)


@pytest.mark.parametrize("max_model_len", [1024, 8192])
def test_concurrency_follows_free_blocks_not_max_model_len(ckpt: Path, max_model_len: int) -> None:
    """A pool of N = 480 tokens, prompts of 24 + 24 generated tokens, max_num_seqs 64: about
    N / 48 = 10 sequences run at once, whatever max_model_len is."""
    prompt = [1] + [5 + i % 50 for i in range(23)]
    engine = make_torch_engine(ckpt, prefix=False, num_blocks=30, block_size=16,
                               max_num_seqs=64, max_model_len=max_model_len,
                               max_num_batched_tokens=512)
    running: list[int] = []
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i in range(32):
        engine.add_request(str(i), prompt, params)
    finished = 0
    while engine.has_unfinished_requests():
        finished += sum(out.finished for out in engine.step())
        running.append(len(engine.scheduler.running))
    assert finished == 32
    busiest = max(running)
    # admission takes blocks for the prompt (2 blocks each: 15 fit), decode growth preempts
    # back down to what prompt + output needs (3 blocks each: 10 fit)
    assert 10 <= busiest <= 15, running
    steady = sorted(running)[len(running) // 2]  # the median step
    assert 8 <= steady <= 15, running
