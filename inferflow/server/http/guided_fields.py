"""The request fields that ask for structured output, turned into one ``GuidedConstraint``.

Accepted on ``/v1/completions`` and ``/v1/chat/completions`` (what vLLM accepts):

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "description", "schema", "strict"}}``;
- vLLM's ``structured_outputs``: ``{"json": schema, "regex": str, "choice": [str],
  "grammar": str, "json_object": true}`` (one of them; ``disable_fallback`` is accepted: there
  is no fallback backend to disable);
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``
  (``guided_decoding_backend`` may name ``guidance``/``llguidance``/``auto``).

At most one constraint per request; anything set that cannot be honoured (a second constraint,
``structural_tag``, ``whitespace_pattern``, another backend) is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from inferflow.sampling_params import GuidedConstraint, GuidedKind
from inferflow.server.http.errors import bad_request

BACKENDS = ("auto", "guidance", "llguidance")


class _Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JsonSchemaFormat(_Forbid):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Forbid):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Forbid):
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False


class GuidedFields(BaseModel):
    """Mixed into the request models: the structured-output fields."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def guided_constraint(self) -> GuidedConstraint | None:
        """The request's one constraint, or None; a 400 when it asks for more or the impossible."""
        if self.guided_decoding_backend not in (None, *BACKENDS):
            raise bad_request(
                f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; "
                f"this server uses llguidance (one of {', '.join(BACKENDS)})",
                "guided_decoding_backend",
            )
        found = [c for c in self._candidates() if c is not None]
        if len(found) > 1:
            raise bad_request(
                f"only one structured-output constraint per request: {found[0].field} and "
                f"{found[1].field} were both given",
                found[1].field,
            )
        return found[0] if found else None

    def _candidates(self) -> list[GuidedConstraint | None]:
        out: list[GuidedConstraint | None] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            out.append(GuidedConstraint(GuidedKind.JSON_OBJECT, "", "response_format"))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request(
                    "response_format.json_schema.schema is required for type json_schema",
                    "response_format.json_schema.schema",
                )
            out.append(GuidedConstraint.json_schema(rf.json_schema.schema_, "response_format"))
        so = self.structured_outputs
        if so is not None:
            out += [
                _schema(so.json_, "structured_outputs.json"),
                _text(GuidedKind.REGEX, so.regex, "structured_outputs.regex"),
                _choice(so.choice, "structured_outputs.choice"),
                _text(GuidedKind.GRAMMAR, so.grammar, "structured_outputs.grammar"),
                GuidedConstraint(GuidedKind.JSON_OBJECT, "", "structured_outputs.json_object")
                if so.json_object
                else None,
            ]
        out += [
            _schema(self.guided_json, "guided_json"),
            _text(GuidedKind.REGEX, self.guided_regex, "guided_regex"),
            _choice(self.guided_choice, "guided_choice"),
            _text(GuidedKind.GRAMMAR, self.guided_grammar, "guided_grammar"),
        ]
        return out


def _schema(value: dict[str, Any] | str | None, field: str) -> GuidedConstraint | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{field}: not a JSON schema: {exc}", field) from None
        if not isinstance(value, dict):
            raise bad_request(f"{field}: a JSON schema must be an object", field)
    return GuidedConstraint.json_schema(value, field)


def _text(kind: GuidedKind, value: str | None, field: str) -> GuidedConstraint | None:
    if value is None:
        return None
    if not value:
        raise bad_request(f"{field} must not be empty", field)
    return GuidedConstraint(kind, value, field)


def _choice(value: list[str] | None, field: str) -> GuidedConstraint | None:
    if value is None:
        return None
    if not value or any(not c for c in value):
        raise bad_request(f"{field} needs at least one non-empty choice", field)
    return GuidedConstraint.choice(value, field)
