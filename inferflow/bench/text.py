"""Synthetic text of a chosen length, counted in tokenizer tokens or, without a tokenizer, words.

With a ``tokenizer.json`` (``tokenizers`` library) the text is built the way vLLM's random
dataset builds it: consecutive ids from the non-special vocabulary starting at a random offset,
decoded, re-encoded and truncated to the target length, and the length re-measured on the final
text (a decode/encode round trip may merge or split tokens). Without a tokenizer, the text is
random common English words and its length is the word count — an approximation of the server's
token count, which the server's ``usage.prompt_tokens`` replaces when it reports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

_WORD_TEXT = """the of and to in is was for on that with as by at from his her they this have had not are
    but were which one their all there been when would who will more each about many some than
    time into only other new could people first what may also over after most made before where
    through between during under world city river country history language system water music
    house school market season number power family story table light answer question
    garden winter summer morning evening station window letter paper engine model signal memory
    orange yellow silver mountain valley forest island bridge harbor castle village library
    doctor teacher farmer pilot writer painter student captain driver baker singer dancer
    travel listen follow measure gather carry explain improve prepare remember decide protect
    quickly slowly carefully quietly simply nearly always often rarely never together around"""
WORDS = tuple(_WORD_TEXT.split())


class TextSource(Protocol):
    """Produces text of (about) ``n`` tokens and reports how many tokens it really has."""

    name: str

    def text(self, n: int, rng: np.random.Generator) -> tuple[str, int]: ...

    def count(self, text: str) -> int: ...


class WordTextSource:
    """Random words; one word counts as one token."""

    name = "words"

    def text(self, n: int, rng: np.random.Generator) -> tuple[str, int]:
        if n <= 0:
            return "", 0
        picks = rng.integers(0, len(WORDS), size=n)
        return " ".join(WORDS[i] for i in picks), n

    def count(self, text: str) -> int:
        return len(text.split())


class TokenizerTextSource:
    """Token-exact text from a Hugging Face ``tokenizer.json``."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))
        special = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids = np.arange(self._tok.get_vocab_size(with_added_tokens=True))
        self._allowed = ids[~np.isin(ids, list(special))] if special else ids
        if len(self._allowed) == 0:
            raise ValueError(f"tokenizer {path} has no non-special tokens")

    def text(self, n: int, rng: np.random.Generator) -> tuple[str, int]:
        if n <= 0:
            return "", 0
        offset = int(rng.integers(0, len(self._allowed)))
        ids = self._allowed[(offset + np.arange(n)) % len(self._allowed)].tolist()
        text = self._tok.decode(ids, skip_special_tokens=True)
        # Round trip: re-encode, keep n tokens, decode again, and count what the text really is.
        ids = self._tok.encode(text, add_special_tokens=False).ids[:n]
        text = self._tok.decode(ids, skip_special_tokens=True)
        return text, self.count(text)

    def count(self, text: str) -> int:
        return len(self._tok.encode(text, add_special_tokens=False).ids)


def make_text_source(tokenizer: str | Path | None) -> TextSource:
    """A tokenizer-backed source when a path is given, else the word source."""
    return TokenizerTextSource(tokenizer) if tokenizer else WordTextSource()
