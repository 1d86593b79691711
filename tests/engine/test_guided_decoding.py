"""Structured output in the engine (the ``guided`` stage + the sampler's bitmask), offline.

On a random-weight model, whose free output is never valid JSON, every constrained output must
match its constraint at temperature 1.0 over many seeds; unconstrained requests sharing a batch
must get exactly the tokens they get alone; a complete grammar ends the request with "stop".
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
from engine_factories import PROMPTS, make_named_checkpoint

from inferflow import LLM, SamplingParams
from inferflow.engine.llm_engine import RequestRejected
from inferflow.sampling.bitmask import allowed_tokens, bitmask_of
from inferflow.sampling_params import GuidedConstraint, GuidedError, GuidedKind
from inferflow.stages.guided import LLGuidanceDecoding, NoGuidedDecoding

SEEDS = range(12)

# nested objects, arrays with bounds, enums, required fields, bounded numbers, string patterns
ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
        "status": {"enum": ["open", "paid", "shipped"]},
        "total": {"type": "number", "minimum": 0, "maximum": 1000},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 6},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "gift": {"type": "boolean"},
    },
    "required": ["id", "status", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_named_checkpoint(tmp_path_factory.mktemp("guided"), "gqa8x2")
    return LLM(path, max_slots=4, max_model_len=512, max_num_batched_tokens=128)


def sampled(seed: int, guided: GuidedConstraint | None, max_tokens: int = 200) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, guided=guided)


def test_json_schema_outputs_always_validate(llm: LLM) -> None:
    constraint = GuidedConstraint.json_schema(ORDER_SCHEMA)
    outs = llm.generate([PROMPTS[0]] * len(SEEDS), [sampled(s, constraint) for s in SEEDS])
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), ORDER_SCHEMA)
    assert len({o.outputs[0].text for o in outs}) > 1  # the seeds really sample


def test_regex_and_choice_outputs_always_match(llm: LLM) -> None:
    pattern = r"[a-f]{2,5}-[0-9]{2}(\.[0-9])?"
    regex = GuidedConstraint(GuidedKind.REGEX, pattern, "guided_regex")
    choices = ["yes", "no", "it depends"]
    choice = GuidedConstraint.choice(choices)
    params = [sampled(s, regex, 30) for s in SEEDS] + [sampled(s, choice, 30) for s in SEEDS]
    outs = llm.generate([PROMPTS[1]] * len(params), params)
    for out in outs[: len(SEEDS)]:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    assert {o.outputs[0].text for o in outs[len(SEEDS) :]} <= set(choices)


def test_a_lark_grammar_constrains_and_completes(llm: LLM) -> None:
    grammar = 'start: "(" item ("," item)* ")"\nitem: /[0-9]/ | "x"'
    constraint = GuidedConstraint(GuidedKind.GRAMMAR, grammar, "guided_grammar")
    for out in llm.generate([PROMPTS[2]] * 6, [sampled(s, constraint, 40) for s in range(6)]):
        text = out.outputs[0].text
        if out.outputs[0].finish_reason == "stop":
            assert re.fullmatch(r"\(([0-9x])(,[0-9x])*\)", text), text
        else:  # cut by max_tokens: a prefix of the language, never free text
            assert re.fullmatch(r"\(([0-9x])(,[0-9x])*,?", text), text


def test_constrained_rows_do_not_change_unconstrained_ones(llm: LLM) -> None:
    free = [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=24, temperature=1.0, seed=7),
    ]
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], free)]
    constraint = GuidedConstraint.json_schema(ORDER_SCHEMA)
    mixed = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[1], PROMPTS[3]],
        [free[0], sampled(1, constraint), free[1], sampled(2, constraint)],
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone


def test_max_tokens_cuts_a_constraint_with_length(llm: LLM) -> None:
    out = llm.generate(PROMPTS[0], sampled(0, GuidedConstraint.json_schema(ORDER_SCHEMA), 5))[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.startswith("{")


def test_compiled_grammars_are_cached_by_constraint(llm: LLM) -> None:
    guided = llm.engine.guided
    before = guided.stats()
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    constraint = GuidedConstraint.json_schema(schema)
    llm.generate([PROMPTS[0]] * 3, [sampled(s, constraint, 20) for s in range(3)])
    after = guided.stats()
    assert after["compiles"] - before["compiles"] == 1
    assert after["cache_hits"] - before["cache_hits"] == 2
    assert after["mask_rows"] > before["mask_rows"] and after["active"] == 0


def test_a_bad_constraint_is_rejected_naming_its_field(llm: LLM) -> None:
    with pytest.raises(RequestRejected) as info:
        llm.engine.add_request(
            "bad", [1, 2, 3], sampled(0, GuidedConstraint(GuidedKind.REGEX, "a(b", "guided_regex"))
        )
    assert info.value.field == "guided_regex" and "unclosed group" in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_check_needs_no_tokenizer_and_none_refuses() -> None:
    with pytest.raises(GuidedError, match="Invalid type"):
        LLGuidanceDecoding().check(
            GuidedConstraint.json_schema({"type": "nope"}, "response_format")
        )
    LLGuidanceDecoding().check(GuidedConstraint.json_schema(ORDER_SCHEMA))
    with pytest.raises(GuidedError, match="disabled") as info:
        NoGuidedDecoding().check(GuidedConstraint.choice(["a"]))
    assert info.value.field == "guided_choice"


def test_bitmask_round_trip() -> None:
    rng = np.random.default_rng(0)
    for vocab in (1, 31, 32, 33, 1000, 1024):
        allowed = rng.random(vocab) < 0.3
        assert (allowed_tokens(bitmask_of(allowed), vocab) == allowed).all()
