"""Tokenizer of a checkpoint: ``tokenizer.json`` (via `tokenizers`), ``tokenizer_config.json``
and the chat template files, read as transformers 5 reads them.

Special tokens: ``encode(text)`` adds what ``tokenizer.json``'s ``post_processor`` adds (a
``TemplateProcessing`` that places BOS, as Llama 3's files have; nothing for none or
``ByteLevel``), exactly as ``AutoTokenizer.from_pretrained(folder).encode(text)``.
``tokenizer_config.json``'s ``add_bos_token`` / ``add_eos_token`` mean nothing when
``tokenizer.json`` is present: transformers 5 drops them for every tokenizer class.

Chat templates: ``inferflow/models/chat_template.py`` (``chat_template.jinja`` and
``additional_chat_templates/`` before ``tokenizer_config.json``'s ``chat_template``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer as HFTokenizer

from inferflow.models.chat_template import (
    compile_template,
    load_chat_templates,
    render_chat,
    select_template,
    special_tokens,
)
from inferflow.models.errors import CheckpointError

if TYPE_CHECKING:
    import jinja2


class Tokenizer:
    """Encode/decode text and render the checkpoint's chat template (see the module docstring).

    ``special_tokens``: the named special tokens (``bos_token``, ``eos_token``, ...) the chat
    template sees; ``chat_templates``: the template, a dict of named ones, or None.
    """

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(path, "tokenizer.json is missing")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(path, f"cannot be parsed ({exc})") from None
        self.config: dict[str, object] = _read_config(folder / "tokenizer_config.json")
        self.special_tokens = special_tokens(folder, self.config)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.chat_templates = load_chat_templates(folder, self.config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._compiled: dict[str, jinja2.Template] = {}  # template source -> compiled

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text`` -> ids; ``add_special_tokens``: what tokenizer.json's post-processor adds."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> str:
        """Render ``messages`` with the checkpoint's chat template as transformers'
        ``apply_chat_template(messages, tools=tools, tokenize=False)`` does (``tools``: OpenAI
        tool definitions; with tools, a template named ``tool_use`` is chosen when there is
        one). Raises ``ValueError`` when the checkpoint has no template (naming the files looked
        in) and jinja's ``TemplateError`` when the template refuses the conversation."""
        source = select_template(self.chat_templates, tools)
        template = self._compiled.get(source)
        if template is None:
            template = self._compiled[source] = compile_template(source)
        return render_chat(template, messages, tools, add_generation_prompt, self.special_tokens)

    def encode_chat(
        self, messages: Sequence[Mapping[str, object]], tools: Sequence[Mapping[str, object]] | None = None
    ) -> list[int]:
        """Chat messages -> prompt token ids: the rendered text encoded without special tokens
        (the template places BOS when it wants one), as transformers does."""
        text = self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)


def _read_config(path: Path) -> dict[str, object]:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(path, f"cannot be parsed ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(path, "must hold a JSON object")
    return config
