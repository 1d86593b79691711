"""The ``reasoning_parser`` slot: a reasoning model's thinking, apart from its answer.

=========  ===================================================================================
``think``  ``<think>...</think>`` goes to ``message.reasoning_content`` (streamed:
           ``delta.reasoning_content``), the rest to ``content``; also when the chat template
           opens ``<think>`` in the prompt (the output then starts inside the reasoning and only
           ``</think>`` appears: DeepSeek-R1, QwQ, Qwen3 templates)
``none``   the output is all content
``auto``   (the default) ``think`` when the checkpoint's chat template mentions ``<think>``,
           else ``none``
=========  ===================================================================================

Contract (:class:`ReasoningParserStage`), in the API process, for ``/v1/chat/completions``:
:meth:`setup` once per process, then :meth:`reader` per request with the prompt's token ids
(None: no reasoning to split). A plugin registers another syntax with
``reasoning_parser._target_=my_pkg.MyParser``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from inferflow.stages.think_reader import ThinkReader
from inferflow.stages.tool_parser import template_text

if TYPE_CHECKING:
    from inferflow.models.tokenizer import Tokenizer
    from inferflow.stages.base import StageContext

_PROMPT_TAIL_TOKENS = 8  # prompt tokens decoded to see whether it opens the reasoning


@dataclass
class ReasoningParserStage:
    """Contract of the ``reasoning_parser`` slot (see the module docstring)."""

    kind: ClassVar[str] = "reasoning_parser"
    option: ClassVar[str] = ""

    def setup(self, context: StageContext) -> None:
        """Once per process: the served model."""
        self._tokenizer: Tokenizer | None = context.tokenizer

    @property
    def resolved(self) -> ReasoningParserStage:
        """The parser in effect (``auto``: the one its template chose)."""
        return self

    def reader(self, prompt_token_ids: Sequence[int] | None) -> ThinkReader | None:
        """The request's reader, or None when the output is all content."""
        return None


@dataclass
class NoReasoningParser(ReasoningParserStage):
    option: ClassVar[str] = "none"


@dataclass
class ThinkReasoningParser(ReasoningParserStage):
    """``<think>...</think>`` (``start``/``end`` name other markers of the same shape)."""

    option: ClassVar[str] = "think"
    start: str = "<think>"
    end: str = "</think>"

    def __post_init__(self) -> None:
        if not self.start or not self.end:
            raise ValueError("start and end: the markers must not be empty")

    def reader(self, prompt_token_ids: Sequence[int] | None) -> ThinkReader | None:
        return ThinkReader(self.start, self.end, inside=self.prompt_opens(prompt_token_ids))

    def prompt_opens(self, prompt_token_ids: Sequence[int] | None) -> bool:
        """Whether the prompt ends inside a reasoning block (the template opened it)."""
        tok = getattr(self, "_tokenizer", None)
        if tok is None or not prompt_token_ids:
            return False
        tail = tok.decode(list(prompt_token_ids[-_PROMPT_TAIL_TOKENS:]), skip_special_tokens=False)
        return tail.rstrip().endswith(self.start)


@dataclass
class AutoReasoningParser(ReasoningParserStage):
    """``think`` when the chat template mentions ``<think>``, else ``none``."""

    option: ClassVar[str] = "auto"

    def __post_init__(self) -> None:
        self._chosen: ReasoningParserStage = NoReasoningParser()

    def setup(self, context: StageContext) -> None:
        super().setup(context)
        think = ThinkReasoningParser()
        self._chosen = think if think.start in template_text(context.tokenizer) else (
            NoReasoningParser()
        )
        self._chosen.setup(context)

    @property
    def resolved(self) -> ReasoningParserStage:
        return self._chosen

    def reader(self, prompt_token_ids: Sequence[int] | None) -> ThinkReader | None:
        return self._chosen.reader(prompt_token_ids)
