"""Tokenizer of a checkpoint: ``tokenizer.json`` (via `tokenizers`) + ``tokenizer_config.json``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from inferflow.models.errors import CheckpointError


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or AddedToken dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    """Encode/decode text and render the checkpoint's chat template."""

    def __init__(self, folder: Path) -> None:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(path, "tokenizer.json is missing")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(path, f"cannot be parsed ({exc})") from None
        cfg_path = folder / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.add_bos_token = bool(self.config.get("add_bos_token", self.bos_token is not None))
        self.chat_template: str | None = self.config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template (as transformers does;
        ``tools``: OpenAI tool definitions, the template's ``tools`` variable)."""
        if not self.chat_template:
            raise ValueError("this checkpoint has no chat_template in tokenizer_config.json")
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.chat_template)
        return template.render(
            messages=list(messages),
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[int]:
        """Chat messages -> prompt token ids (the template already places BOS when it wants one)."""
        text = self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)
