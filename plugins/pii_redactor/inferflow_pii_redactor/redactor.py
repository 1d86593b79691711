"""The PII redactor stages: regex detectors, applied to the prompt and every chat message before
the engine (:class:`PIIRedactor`), and to the generated text after it (:class:`PIIOutputRedactor`)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from inferflow.stages.base import RequestStage, StageRequest
from inferflow.stages.response import HoldBackBuffer, ResponseDelta, ResponseStage


def _luhn_ok(text: str) -> bool:
    digits = [int(c) for c in text if c.isdigit()]
    if not 13 <= len(digits) <= 19:
        return False
    total = 0
    for i, d in enumerate(reversed(digits)):
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
# Order matters: card numbers and SSNs are replaced before the looser phone pattern sees them.
ENTITIES: dict[str, tuple[re.Pattern[str], Any]] = {
    "email": (
        re.compile(r"\b[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b"),
        None,
    ),
    "credit_card": (re.compile(r"\b\d(?:[ -]?\d){12,18}\b"), _luhn_ok),
    "ssn": (re.compile(r"\b\d{3}-\d{2}-\d{4}\b"), None),
    "ipv4": (re.compile(rf"\b{_OCTET}(?:\.{_OCTET}){{3}}\b"), None),
    "phone": (
        re.compile(r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{3}\)|\d{3})[ .-]?\d{3}[ .-]?\d{4}\b"),
        None,
    ),
}


@dataclass
class PIIRedactor(RequestStage):
    """Replace personal data in ``prompt`` and chat ``messages`` with ``[ENTITY]`` markers.

    ``entities``: which detectors run (see :data:`ENTITIES`); ``replacement``: the marker,
    ``{entity}`` is the upper-case entity name. Requests given as token ids pass unchanged.
    Per-request counts land in ``attributes["pii_redactor.redactions"]``.
    """

    entities: list[str] = field(default_factory=lambda: list(ENTITIES))
    replacement: str = "[{entity}]"

    def __post_init__(self) -> None:
        unknown = [e for e in self.entities if e not in ENTITIES]
        if unknown:
            raise ValueError(f"entities: unknown {unknown}; allowed values: {', '.join(ENTITIES)}")
        # detectors in ENTITIES order, whatever order the config lists them in
        self.detectors = [(name, *ENTITIES[name]) for name in ENTITIES if name in self.entities]

    def redact(self, text: str, counts: Counter[str]) -> str:
        for name, pattern, check in self.detectors:
            marker = self.replacement.format(entity=name.upper())

            def sub(
                m: re.Match[str], name: str = name, check: Any = check, marker: str = marker
            ) -> str:
                if check is not None and not check(m.group(0)):
                    return m.group(0)
                counts[name] += 1
                return marker

            text = pattern.sub(sub, text)
        return text

    def process(self, request: StageRequest) -> StageRequest:
        counts: Counter[str] = Counter()
        if request.prompt is not None:
            request.prompt = self.redact(request.prompt, counts)
        if request.messages is not None:
            request.messages = [self._redact_message(m, counts) for m in request.messages]
        if counts:
            request.attributes[f"{self.name}.redactions"] = dict(counts)
        return request

    def _redact_message(self, message: dict[str, Any], counts: Counter[str]) -> dict[str, Any]:
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": self.redact(content, counts)}
        if isinstance(content, list):
            parts = [
                {**p, "text": self.redact(p["text"], counts)}
                if isinstance(p, dict) and isinstance(p.get("text"), str)
                else p
                for p in content
            ]
            return {**message, "content": parts}
        return message


@dataclass
class PIIOutputRedactor(ResponseStage):
    """Replace personal data in the *generated* text, streamed or not, with the same markers.

    Text is held back until it is at least ``window`` characters behind the newest token and
    not inside a possible match, so an entity split across deltas is still redacted whole.
    """

    entities: list[str] = field(default_factory=lambda: list(ENTITIES))
    replacement: str = "[{entity}]"
    window: int = 64

    def __post_init__(self) -> None:
        self._redactor = PIIRedactor(self.entities, self.replacement)
        if self.window < 1:
            raise ValueError(f"window: must be >= 1, got {self.window}")

    def start(self, request: StageRequest) -> HoldBackBuffer:
        return HoldBackBuffer(self.window)

    def process(self, delta: ResponseDelta, state: HoldBackBuffer) -> ResponseDelta:
        ready = state.feed(delta.text, delta.final, self._matches)
        return delta.with_text(self._redactor.redact(ready, Counter()) if ready else "")

    def _matches(self, text: str) -> list[tuple[int, int]]:
        return [
            m.span() for _, pattern, _ in self._redactor.detectors for m in pattern.finditer(text)
        ]
