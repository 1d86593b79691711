"""Datasets: lengths, spread, sharing, determinism, JSONL parsing, tokenizer-exact prompts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from inferflow.bench.datasets import DatasetConfig, build_dataset
from inferflow.bench.text import WORDS, TokenizerTextSource, WordTextSource, make_text_source


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word-level tokenizer.json trained on the word list, with two special tokens."""
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator([" ".join(WORDS)] * 3, trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_random_lengths_stay_in_the_spread_range() -> None:
    cfg = DatasetConfig(num_prompts=200, input_len=40, output_len=10, range_ratio=0.5, seed=1)
    reqs = build_dataset(cfg, WordTextSource())
    assert len(reqs) == 200
    assert all(20 <= r.prompt_len <= 60 for r in reqs)
    assert all(5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 10  # actually spread
    assert all(r.prompt_len == len(r.prompt.split()) for r in reqs)


def test_zero_range_ratio_gives_fixed_lengths_and_prefix_is_shared() -> None:
    cfg = DatasetConfig(num_prompts=5, input_len=12, output_len=7, prefix_len=8)
    reqs = build_dataset(cfg, WordTextSource())
    assert {(r.prompt_len, r.expected_output_len) for r in reqs} == {(20, 7)}
    prefixes = {" ".join(r.prompt.split()[:8]) for r in reqs}
    assert len(prefixes) == 1


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    cfg = DatasetConfig(num_prompts=4, input_len=10, range_ratio=0.3, seed=7)
    assert build_dataset(cfg, WordTextSource()) == build_dataset(cfg, WordTextSource())
    other = DatasetConfig(num_prompts=4, input_len=10, range_ratio=0.3, seed=8)
    assert build_dataset(cfg, WordTextSource()) != build_dataset(other, WordTextSource())


def test_shared_prefix_groups_requests_by_system_prompt() -> None:
    cfg = DatasetConfig(
        name="shared-prefix",
        num_prompts=6,
        prefix_len=30,
        num_prefixes=2,
        input_len=5,
        output_len=4,
    )
    reqs = build_dataset(cfg, WordTextSource())
    systems = [r.messages[0] for r in reqs if r.messages]
    assert len(systems) == 6 and {role for role, _ in systems} == {"system"}
    assert systems[0] == systems[2] == systems[4] != systems[1] == systems[3] == systems[5]
    assert len(systems[0][1].split()) == 30
    assert len({r.messages[1][1] for r in reqs if r.messages}) == 6  # every question differs
    assert all(r.prompt.startswith(r.messages[0][1]) for r in reqs if r.messages)
    assert reqs[0].chat_messages()[0] == {"role": "system", "content": systems[0][1]}


def test_long_doc_reuses_documents_round_robin() -> None:
    cfg = DatasetConfig(name="long-doc", num_prompts=5, input_len=300, num_docs=2, output_len=8)
    reqs = build_dataset(cfg, WordTextSource())
    docs = [r.prompt.split("\n\n")[0] for r in reqs]
    assert docs[0] == docs[2] == docs[4] != docs[1] == docs[3]
    assert all(r.prompt_len > 300 for r in reqs)  # document plus instruction
    own = build_dataset(
        DatasetConfig(name="long-doc", num_prompts=3, input_len=50), WordTextSource()
    )
    assert len({r.prompt.split("\n\n")[0] for r in own}) == 3


def test_jsonl_prompts_messages_and_cycling(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "one two three", "output_len": 5}),
        "",
        json.dumps("bare string prompt"),
        json.dumps({"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}),
    ]
    path.write_text("\n".join(lines) + "\n")
    reqs = build_dataset(
        DatasetConfig(name="jsonl", path=str(path), output_len=9), WordTextSource()
    )
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [
        ("one two three", 3, 5),
        ("bare string prompt", 3, 9),
        ("hi there", 2, 3),
    ]
    assert reqs[2].chat_messages() == [{"role": "user", "content": "hi there"}]
    cycled = build_dataset(
        DatasetConfig(name="jsonl", path=str(path), num_prompts=7), WordTextSource()
    )
    assert [r.prompt for r in cycled][3:6] == [r.prompt for r in reqs]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{oops", "not valid JSON"),
        ('{"prompt": 3}', "string 'prompt'"),
        ('{"prompt": "x", "output_len": 0}', "output_len"),
        ("[1, 2]", "object or a string"),
        ('{"messages": [{"content": "x"}]}', "'role' and 'content'"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps("fine") + "\n" + line + "\n")
    with pytest.raises(ValueError, match=message) as info:
        build_dataset(DatasetConfig(name="jsonl", path=str(path)), WordTextSource())
    assert f"{path}:2" in str(info.value)


@pytest.mark.parametrize(
    "cfg",
    [
        DatasetConfig(name="nope"),
        DatasetConfig(range_ratio=1.0),
        DatasetConfig(num_prompts=0),
        DatasetConfig(output_len=0),
        DatasetConfig(name="jsonl"),
        DatasetConfig(num_prefixes=0),
    ],
)
def test_invalid_configs_are_rejected(cfg: DatasetConfig) -> None:
    with pytest.raises(ValueError):
        build_dataset(cfg, WordTextSource())


def test_tokenizer_prompts_have_exact_token_lengths(tokenizer_path: Path) -> None:
    source = make_text_source(tokenizer_path.parent)  # a folder holding tokenizer.json works
    assert isinstance(source, TokenizerTextSource)
    cfg = DatasetConfig(num_prompts=20, input_len=50, range_ratio=0.2, output_len=4, seed=3)
    tok = Tokenizer.from_file(str(tokenizer_path))
    for r in build_dataset(cfg, source):
        ids = tok.encode(r.prompt, add_special_tokens=False).ids
        assert len(ids) == r.prompt_len
        assert math.floor(50 * 0.8) <= r.prompt_len <= math.ceil(50 * 1.2)
        assert not {tok.token_to_id(s) for s in ("<unk>", "<s>", "</s>")} & set(ids)


def test_missing_tokenizer_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        make_text_source(tmp_path / "nothing.json")
