"""``GuidedConstraint``: what a request's output must match, as it travels to the engine.

Built by the HTTP layer from ``response_format``, ``structured_outputs`` or vLLM's ``guided_*``
fields (``inferflow/server/http/guided_fields.py``), or directly by offline users through
``SamplingParams(guided=...)``. It is plain data (picklable, hashable): the grammar stage
compiles it on the engine side, with a cache keyed by ``key``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum
from typing import Any


class GuidedKind(str, Enum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec: ""
    REGEX = "regex"  # spec: the regular expression (Rust ``regex`` syntax)
    CHOICE = "choice"  # spec: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # spec: a Lark or GBNF (llama.cpp) grammar


@dataclass(frozen=True)
class GuidedConstraint:
    kind: GuidedKind
    spec: str = ""
    field: str = "structured_outputs"  # the request field it came from, named in 400s

    @property
    def key(self) -> tuple[str, str]:
        """What identifies the compiled grammar (not where the request spelled it)."""
        return (self.kind.value, self.spec)

    @classmethod
    def json_schema(
        cls, schema: dict[str, Any] | str, field: str = "guided_json"
    ) -> GuidedConstraint:
        text = schema if isinstance(schema, str) else json.dumps(schema)  # key order matters
        return cls(GuidedKind.JSON_SCHEMA, text, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> GuidedConstraint:
        return cls(GuidedKind.CHOICE, json.dumps(list(choices)), field)


class GuidedError(ValueError):
    """A constraint that cannot be compiled; ``field`` names the request field (HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
