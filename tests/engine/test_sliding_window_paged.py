"""A sliding-window model through the scheduler and the paged torch executor: the blocks behind
the window go back to the pool while the sequence runs, so a context longer than the whole
pool is served, and greedy output is transformers' (depends on the torch executor's windowed
attention, which masks the freed table entries out)."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_factories import transformers_reference
from hf_checkpoints import long_prompt, save_hf_checkpoint

from inferflow import LLM, SamplingParams
from inferflow.models.checkpoint import load_checkpoint
from inferflow.scheduling.layout import window_blocks

pytest.importorskip("torch")
pytest.importorskip("transformers")

WINDOW, PROMPT_TOKENS, N_NEW, BLOCK, NUM_BLOCKS, CHUNK = 32, 200, 40, 8, 16, 64


def test_a_windowed_mistral_decodes_past_a_pool_smaller_than_its_context(tmp_path: Path) -> None:
    path = save_hf_checkpoint(tmp_path / "mistral", "MistralForCausalLM", seed=11,
                              sliding_window=WINDOW)
    prompt = long_prompt(load_checkpoint(path).tokenizer, PROMPT_TOKENS)
    want, _ = transformers_reference(path, prompt, N_NEW)

    # 16 blocks of 8 = 128 tokens of KV for a 240-token sequence: only the window's are held
    assert NUM_BLOCKS * BLOCK < PROMPT_TOKENS + N_NEW
    assert window_blocks(WINDOW, BLOCK, CHUNK) <= NUM_BLOCKS
    llm = LLM(path, backend="torch", compile="eager", block_size=BLOCK, num_blocks=NUM_BLOCKS,
              max_model_len=256, max_num_seqs=2, max_num_batched_tokens=CHUNK)
    layout = llm.engine.layout
    assert layout.paged and layout.freeing_window == WINDOW and layout.max_model_len == 256

    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    (first,) = llm.generate([prompt], params)
    assert list(first.outputs[0].token_ids) == want
    # the same prompt again: a prefix hit on the blocks within the window of its end (the
    # table's earlier entries are the null block), and the same tokens
    (again,) = llm.generate([prompt], params)
    assert list(again.outputs[0].token_ids) == want
    assert llm.engine.stats().prefix_cache_hits > 0
    assert llm.engine.stats().num_kv_blocks_used == 0
