"""What a request's output must match: `StructuredOutputsParams`, shaped like vLLM's."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from typing import Any

from specdecode.errors import UserError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on the whole output; set exactly one of the first five fields.

    json: a JSON schema (a dict, or its JSON text; kept as text): the output is one JSON value
        that validates against it (objects keep the schema's property order).
    json_object: True = the output is any JSON object (`response_format: {"type":
        "json_object"}`).
    regex: the output matches this regular expression from start to end.
    choice: the output is exactly one of these strings.
    grammar: an EBNF grammar (xgrammar's GBNF dialect, start rule `root`) the output matches.
    disable_any_whitespace: JSON only: no optional whitespace (a compact one-line value)
        instead of any amount of it between tokens of the JSON syntax.
    Example: StructuredOutputsParams(choice=("yes", "no")) lets the model answer "yes" or "no"
    and then only its end-of-sequence token.
    """

    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            object.__setattr__(self, "json", jsonlib.dumps(self.json))
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise UserError(
                f"structured outputs take exactly one of {', '.join(KINDS)}, got "
                f"{', '.join(given) or 'none'}"
            )
        if self.json is not None:
            if not isinstance(self.json, str):
                raise UserError(
                    f"json must be a JSON schema (dict or JSON text), got {self.json!r}"
                )
            try:
                schema = jsonlib.loads(self.json)
            except ValueError as err:
                raise UserError(
                    f"json must be a JSON schema, but its text is not JSON: {err}"
                ) from None
            if not isinstance(schema, (dict, bool)):
                raise UserError(
                    f"a JSON schema is an object or a bool, got {type(schema).__name__}"
                )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise UserError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None and (
            isinstance(self.choice, str)
            or not self.choice
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise UserError(f"choice must be a list of non-empty strings, got {self.choice!r}")
        if not isinstance(self.json_object, bool) or not isinstance(
            self.disable_any_whitespace, bool
        ):
            raise UserError("json_object and disable_any_whitespace must be true or false")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """Build from a dict of fields, naming any unknown key."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise UserError(f"structured outputs have no field {unknown}; known: {known}")
        return cls(**values)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))
