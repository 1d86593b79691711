"""Tokenizer files as transformers 5 reads them: special tokens from tokenizer.json's
post-processor (never ``add_bos_token``), chat templates from the files ``save_pretrained`` writes
today and from the legacy ``tokenizer_config.json`` forms. The oracle is transformers itself on
the same folder."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from inferflow.models.chat_template import CHAT_TEMPLATE_DIR, CHAT_TEMPLATE_FILE
from inferflow.models.tiny import CHAT_TEMPLATE, train_tokenizer
from inferflow.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

BOS, EOS = "<|begin_of_text|>", "<|eot_id|>"
TEXTS = ["Hello world", "  two spaces\nand a newline", f"{BOS}already here {EOS} twice",
         "héllo ünicode 12345"]
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief.", "name": None},  # None keys are dropped
    {"role": "user", "content": "Héllo \"there\" <tag>"},
]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Wéather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
# transformers' environment: loopcontrols, tojson options, namespace, dict, {% generation %}
TOOL_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}"
    "{% if tools is not none %}TOOLS {{ tools | tojson(indent=1, sort_keys=true) }}\n{% endif %}"
    "{% for m in messages %}{% if m.name is defined %}{{ raise_exception('name kept') }}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{% if loop.index > 5 %}{% break %}{% endif %}"
    "{% generation %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% endfor %}"
    "{{ dict(a=ns.n) | tojson }}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small trained byte-level BPE (with the Llama 3 post-processor train_tokenizer writes)."""
    out = tmp_path_factory.mktemp("trained")
    train_tokenizer(1024, out)
    return out


def _folder(root: Path, trained: Path, post: str, add_bos: bool | None, cls: str) -> Path:
    out = root / f"{post}-{add_bos}-{cls}"
    out.mkdir()
    tok = tokenizers.Tokenizer.from_file(str(trained / "tokenizer.json"))
    if post == "none":
        tok.post_processor = None
    elif post == "bytelevel":
        tok.post_processor = tokenizers.processors.ByteLevel(trim_offsets=False)
    tok.save(str(out / "tokenizer.json"))
    config: dict[str, Any] = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": cls}
    if add_bos is not None:
        config["add_bos_token"] = add_bos
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_train_tokenizer_places_bos_with_its_post_processor(trained: Path) -> None:
    raw = json.loads((trained / "tokenizer.json").read_text())
    assert raw["post_processor"]["type"] == "TemplateProcessing"
    ours = Tokenizer(trained)
    assert ours.encode("Hello")[0] == ours.bos_token_id
    assert ours.encode("Hello", add_special_tokens=False) == ours.encode("Hello")[1:]


def test_special_tokens_come_from_the_post_processor_as_in_transformers(
    trained: Path, tmp_path: Path
) -> None:
    cases = itertools.product(
        ["none", "template", "bytelevel"], [True, False, None],
        ["PreTrainedTokenizerFast", "LlamaTokenizerFast", "Qwen2Tokenizer"],
    )
    seen_bos = set()
    for post, add_bos, cls in cases:
        folder = _folder(tmp_path, trained, post, add_bos, cls)
        ours, theirs = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
        for text in TEXTS:
            ids = ours.encode(text)
            assert ids == theirs.encode(text), (post, add_bos, cls, text)
            assert ours.encode(text, add_special_tokens=False) == theirs.encode(
                text, add_special_tokens=False
            )
            if not text.startswith(BOS):
                seen_bos.add((post, ids[0] == ours.bos_token_id))
    # the matrix has teeth: only the template post-processor adds BOS, whatever add_bos_token says
    assert seen_bos == {("none", False), ("bytelevel", False), ("template", True)}


def _save_with_transformers(trained: Path, out: Path, template: Any, jinja_files: bool) -> None:
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(trained / "tokenizer.json"), bos_token=BOS, eos_token=EOS,
        pad_token=EOS,
    )
    tok.chat_template = template
    tok.save_pretrained(out, save_jinja_files=jinja_files)


def _assert_chat_matches(folder: Path, tools: list[dict[str, Any]] | None) -> str:
    ours, theirs = Tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    text = theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False,
                                      add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, tools=tools) == text
    ids = theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    assert ours.encode_chat(MESSAGES, tools=tools) == ids
    return text


def test_single_template_saved_by_transformers(trained: Path, tmp_path: Path) -> None:
    _save_with_transformers(trained, tmp_path, TOOL_TEMPLATE, jinja_files=True)
    assert (tmp_path / CHAT_TEMPLATE_FILE).is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    text = _assert_chat_matches(tmp_path, tools=TOOLS)
    assert text.startswith(BOS) and '"name": "get_weather"' in text and "Wéather" in text
    assert '{"a": 2}' in text and "<tag>" in text  # tojson does not escape HTML
    assert "TOOLS" not in _assert_chat_matches(tmp_path, tools=None)


@pytest.mark.parametrize("jinja_files", [True, False], ids=["jinja-files", "legacy-list"])
def test_named_templates_pick_tool_use_with_tools(
    trained: Path, tmp_path: Path, jinja_files: bool
) -> None:
    named = {"default": CHAT_TEMPLATE, "tool_use": TOOL_TEMPLATE}
    _save_with_transformers(trained, tmp_path, named, jinja_files)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if jinja_files:
        assert (tmp_path / CHAT_TEMPLATE_DIR / "tool_use.jinja").is_file()
        assert "chat_template" not in config
    else:
        assert isinstance(config["chat_template"], list)  # [{"name", "template"}, ...]
        assert not (tmp_path / CHAT_TEMPLATE_FILE).exists()
    assert "TOOLS" in _assert_chat_matches(tmp_path, tools=TOOLS)
    assert "TOOLS" not in _assert_chat_matches(tmp_path, tools=None)


def test_a_dict_in_tokenizer_config_and_files_taking_priority(
    trained: Path, tmp_path: Path
) -> None:
    shutil.copy(trained / "tokenizer.json", tmp_path / "tokenizer.json")
    config = {"bos_token": BOS, "eos_token": EOS,
              "chat_template": {"default": CHAT_TEMPLATE, "tool_use": TOOL_TEMPLATE}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert "TOOLS" in _assert_chat_matches(tmp_path, tools=TOOLS)
    # a chat_template.jinja replaces every template of the config (tool_use included)
    (tmp_path / CHAT_TEMPLATE_FILE).write_text("{{ bos_token }}FILE{{ messages[-1]['content'] }}")
    assert _assert_chat_matches(tmp_path, tools=TOOLS).startswith(f"{BOS}FILE")


def test_templates_without_a_default_and_no_template_at_all(
    trained: Path, tmp_path: Path
) -> None:
    shutil.copy(trained / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS}))
    with pytest.raises(ValueError, match=r"chat_template\.jinja.*tokenizer_config\.json"):
        Tokenizer(tmp_path).encode_chat(MESSAGES)
    (tmp_path / CHAT_TEMPLATE_DIR).mkdir()
    (tmp_path / CHAT_TEMPLATE_DIR / "rag.jinja").write_text("x")
    (tmp_path / CHAT_TEMPLATE_DIR / "tool_use.jinja").write_text("y")
    ours = Tokenizer(tmp_path)
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS) == "y"
    with pytest.raises(ValueError, match=r"none named default.*\['rag', 'tool_use'\]"):
        ours.apply_chat_template(MESSAGES)
