"""The offline API: LLM.generate / LLM.chat on the engine loop."""

from __future__ import annotations

import pytest
from engine_factories import PROMPTS, make_named_checkpoint

from inferflow import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_named_checkpoint(tmp_path_factory.mktemp("llm"), "gqa8x2")
    return LLM(path, max_slots=4, max_model_len=256, max_num_batched_tokens=64)


def greedy(max_tokens: int = 16, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)  # type: ignore[arg-type]


def test_generate_returns_tokens_and_text_in_order(llm: LLM) -> None:
    outs = llm.generate(PROMPTS, greedy())
    assert [o.prompt for o in outs] == PROMPTS
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 16 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)


def test_batched_generation_equals_one_at_a_time(llm: LLM) -> None:
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(24))]
    alone = [llm.generate(p, greedy(24))[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone


def test_stop_token_ids_and_stop_strings(llm: LLM) -> None:
    base = llm.generate(PROMPTS[0], greedy(16))[0].outputs[0]
    stop_tok = base.token_ids[5]
    first = base.token_ids.index(stop_tok)
    out = llm.generate(PROMPTS[0], greedy(16, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.token_ids == base.token_ids[: first + 1]
    stop_text = base.text[len(base.text) // 2:][:3]
    out = llm.generate(PROMPTS[0], greedy(16, stop=[stop_text]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    assert out.text == base.text[: base.text.index(stop_text)]


def test_seeded_sampling_is_reproducible_in_any_batch(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=7, max_tokens=12)
    alone = llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[1]], [greedy(12), params])[1].outputs[0].token_ids
    assert alone == mixed


def test_logprobs_returned_per_token(llm: LLM) -> None:
    c = llm.generate(PROMPTS[2], greedy(6, logprobs=2))[0].outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 6
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert lp.token_id == tok and lp.logprob <= 0 and lp.top[0][0] == tok  # greedy = top-1


def test_chat_applies_the_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is two plus two?"}]
    out = llm.chat(messages, greedy(8))[0]
    assert out.prompt_token_ids == llm.tokenizer.encode_chat(messages)
    assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False).startswith(
        "<|begin_of_text|><|start_header_id|>user")


def test_use_tqdm_shows_progress_on_stderr(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    llm.generate(PROMPTS, greedy(2), use_tqdm=True)
    assert f"{len(PROMPTS)}/{len(PROMPTS)}" in capsys.readouterr().err
    llm.generate(PROMPTS, greedy(2))  # the default: silent
    assert capsys.readouterr().err == ""


def test_the_torch_backend_generates_what_onnx_runtime_does(
    llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``LLM(path, backend="torch", ...)``: the paged torch executor, sized by kv_cache_memory."""
    pytest.importorskip("torch")
    path = make_named_checkpoint(tmp_path_factory.mktemp("llm_torch"), "gqa8x2")
    paged = LLM(path, backend="torch", compile="eager", kv_cache_memory="2MiB",
                max_num_seqs=4, max_num_batched_tokens=64)
    layout = paged.engine.layout
    assert layout.paged and layout.num_blocks * layout.block_size * 1024 <= 2 * 1024**2
    got = [o.outputs[0].token_ids for o in paged.generate(PROMPTS, greedy(20))]
    assert got == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(20))]


def test_defaults_are_the_servers(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Without settings the offline engine runs what ``python -m inferflow`` runs: the continuous
    batching stage's budgets, as many slots as sequences, the checkpoint's whole context."""
    from inferflow.stages.batching import ContinuousBatching

    path = make_named_checkpoint(tmp_path_factory.mktemp("defaults"), "gqa8x2")
    engine = LLM(path).engine
    server = ContinuousBatching()
    config = engine.scheduler.budgets
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (
        server.max_num_seqs, server.max_num_batched_tokens)
    assert engine.layout.max_slots == server.max_num_seqs
    assert engine.max_model_len == engine.model_config.max_position_embeddings
    given = LLM(path, max_num_seqs=3, max_num_batched_tokens=96, max_model_len=128).engine
    assert (given.scheduler.budgets.max_num_seqs, given.scheduler.budgets.max_num_batched_tokens,
            given.layout.max_slots, given.max_model_len) == (3, 96, 3, 128)
    one = LLM(path, mode="none", max_model_len=64).engine  # batching=none's budgets
    assert (one.scheduler.budgets.max_num_seqs, one.layout.max_slots) == (1, 1)


def test_a_small_memory_lowers_the_default_context(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The automatic KV budget sizes the offline engine as it sizes the server: slots and their
    prefix pool share half of the memory left after the weights (at least 256 MiB)."""
    from inferflow.scheduling import kv_budget

    monkeypatch.setattr(kv_budget, "physical_memory_bytes", lambda: 0)  # the 256 MiB floor
    path = make_named_checkpoint(tmp_path_factory.mktemp("small"), "gqa8x2")
    engine = LLM(path, max_num_seqs=256, graph_form="gqa").engine  # the slot layout
    arch = engine.model_config
    per_token = kv_budget.kv_bytes_per_token(arch, 4)
    fit = kv_budget.MIN_AUTO_BYTES // per_token // (2 * 256) // 16 * 16  # slots + an equal pool
    assert engine.max_model_len == min(fit, arch.max_position_embeddings)
    assert engine.max_model_len < arch.max_position_embeddings  # the budget decided it


def test_kv_cache_memory_sizes_the_offline_engine_as_the_servers_key_does(
    tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture
) -> None:
    """``kv_cache_memory`` is ``executor.kv_cache_memory``: a context that does not fit is
    lowered with a warning (an explicit ``max_model_len`` too), one that cannot be served at all
    is an error naming the keyword."""
    from inferflow.scheduling import kv_budget

    path = make_named_checkpoint(tmp_path_factory.mktemp("budget"), "gqa8x2")
    small = LLM(path, max_num_seqs=4, max_model_len=2048, kv_cache_memory="1MiB",
                graph_form="gqa").engine
    per_token = kv_budget.kv_bytes_per_token(small.model_config, 4)
    assert small.max_model_len == 1024**2 // per_token // (2 * 4) // 16 * 16 < 2048
    assert "max_model_len 2048 does not fit the KV budget" in caplog.text
    assert "kv_cache_memory=1MiB" in caplog.text
    with pytest.raises(ValueError, match=r"^kv_cache_memory: .*max_num_seqs"):
        LLM(path, max_num_seqs=64, kv_cache_memory="64KiB", graph_form="gqa")
