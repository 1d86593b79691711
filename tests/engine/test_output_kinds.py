"""What ``LLMEngine.step`` reports per ``SamplingParams.output_kind`` (vLLM's RequestOutputKind):
DELTA outputs add up to the cumulative ones, FINAL_ONLY reports each request once."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest
from engine_factories import PROMPTS, make_named_checkpoint

from inferflow import LLM, RequestOutputKind, SamplingParams
from inferflow.engine.llm_engine import LLMEngine
from inferflow.outputs import RequestOutput, TokenLogprob
from inferflow.sampling_params import SamplingParamsError


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    path = make_named_checkpoint(tmp_path_factory.mktemp("kinds"), "gqa8x2")
    return LLM(path, max_slots=4, max_model_len=256, max_num_batched_tokens=64).engine


def run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Every output of each request, in step order (request ids are the prompt's index)."""
    for i, p in enumerate(params):
        text = PROMPTS[i % len(PROMPTS)]
        engine.add_request(str(i), engine.tokenizer.encode(text), p, prompt=text)
    outputs: dict[str, list[RequestOutput]] = defaultdict(list)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return outputs


def same_logprobs(got: list[TokenLogprob], want: list[TokenLogprob]) -> None:
    """The same tokens and alternatives; values up to float noise (another run's logits)."""
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got] == [
        (lp.token_id, [t for t, _ in lp.top]) for lp in want]
    assert [lp.logprob for lp in got] == pytest.approx([lp.logprob for lp in want], abs=1e-4)


PARAMS = [
    SamplingParams(max_tokens=14, temperature=0.0, logprobs=2),
    SamplingParams(max_tokens=11, temperature=0.8, seed=3),
    SamplingParams(max_tokens=20, temperature=0.0, stop=["e"]),  # ends on a stop string
    SamplingParams(max_tokens=9, temperature=0.0, logprobs=0, ignore_eos=True),
]


@pytest.mark.parametrize("stream_interval", [1, 3])
def test_delta_outputs_add_up_to_the_cumulative_ones(engine: LLMEngine, stream_interval: int) -> None:
    engine.detokenizer.stream_interval = stream_interval
    try:
        cumulative = run(engine, PARAMS)
        delta = run(engine, [replace(p, output_kind=RequestOutputKind.DELTA) for p in PARAMS])
    finally:
        engine.detokenizer.stream_interval = 1
    assert cumulative.keys() == delta.keys() == {str(i) for i in range(len(PARAMS))}
    for rid, outs in delta.items():
        final = cumulative[rid][-1].outputs[0]
        pieces = [o.outputs[0] for o in outs]
        assert len(outs) == len(cumulative[rid])  # the same outputs, holding less
        assert "".join(c.text for c in pieces) == final.text
        assert [t for c in pieces for t in c.token_ids] == final.token_ids
        assert all(c.token_ids == c.delta_token_ids and c.text == c.delta_text for c in pieces)
        if final.logprobs is None:
            assert all(c.logprobs is None for c in pieces)
        else:
            same_logprobs([lp for c in pieces for lp in c.logprobs or []], final.logprobs)
        assert outs[0].prompt_token_ids == cumulative[rid][0].prompt_token_ids != []
        assert all(o.prompt_token_ids == [] for o in outs[1:])  # the prompt comes once
        assert outs[0].prompt == cumulative[rid][-1].prompt == PROMPTS[int(rid) % len(PROMPTS)]
        assert all(o.prompt is None for o in outs[1:])
        assert (pieces[-1].finish_reason, pieces[-1].stop_reason) == (
            final.finish_reason, final.stop_reason)
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert cumulative["2"][-1].outputs[0].finish_reason == "stop"  # the stop string was tested


def test_final_only_reports_each_request_once_as_the_cumulative_output(engine: LLMEngine) -> None:
    cumulative = run(engine, PARAMS)
    final = run(engine, [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in PARAMS])
    for rid, outs in final.items():
        assert len(outs) == 1 and outs[0].finished
        want, got = cumulative[rid][-1], outs[0]
        assert got.prompt_token_ids == want.prompt_token_ids
        a, b = got.outputs[0], want.outputs[0]
        assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
            b.text, b.token_ids, b.finish_reason, b.stop_reason)
        assert (a.logprobs is None) == (b.logprobs is None)
        same_logprobs(a.logprobs or [], b.logprobs or [])


def test_generate_asks_for_final_outputs_only_and_leaves_the_params_alone(
    engine: LLMEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = LLM.__new__(LLM)  # the offline API over this engine
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    llm._ids = iter(range(100, 200))  # type: ignore[assignment]
    reported: list[RequestOutput] = []
    step = engine.step

    def recorded_step() -> list[RequestOutput]:
        outputs = step()
        reported.extend(outputs)
        return outputs

    monkeypatch.setattr(engine, "step", recorded_step)
    params = SamplingParams(max_tokens=7, temperature=0.0)
    outs = llm.generate(PROMPTS[:2], params)
    assert params.output_kind is RequestOutputKind.CUMULATIVE
    assert len(reported) == 2 and all(o.finished for o in reported)  # nothing built meanwhile
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 7]
    assert all(o.outputs[0].text == engine.tokenizer.decode(o.outputs[0].token_ids) for o in outs)


def test_output_kind_must_be_a_request_output_kind() -> None:
    with pytest.raises(SamplingParamsError, match="output_kind"):
        SamplingParams(output_kind="delta")  # type: ignore[arg-type]
