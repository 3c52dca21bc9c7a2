"""Constraints for the structured-output tests: 22 JSON schemas (nested objects, arrays, enums,
numbers, strings with patterns and lengths), bounded so that even a tiny random model reaches
their end within a few dozen tokens, plus regex, choice and grammar constraints."""

from __future__ import annotations

from typing import Any

WORD = {"type": "string", "maxLength": 6}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "boolean"},
    {"type": "null"},
    SMALL_INT,
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "string", "maxLength": 8},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": SMALL_INT, "maxItems": 4},
    {"type": "array", "prefixItems": [WORD, SMALL_INT], "items": False},
    {"type": "object", "properties": {"name": WORD, "age": SMALL_INT}, "required": ["name", "age"]},
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "code": {"enum": [200, 404, 500]}},
        "required": ["ok", "code"],
    },
    {
        "type": "object",
        "properties": {"id": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}},
        "required": ["id"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": WORD, "maxItems": 2}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"first": WORD, "last": WORD},
                "required": ["first", "last"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"sku": WORD, "qty": SMALL_INT},
                    "required": ["sku", "qty"],
                },
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"level": {"type": "string", "enum": ["low", "mid", "high"]}, "n": SMALL_INT},
        "required": ["level"],
    },
    {
        "type": "object",
        "properties": {"value": {"anyOf": [SMALL_INT, {"type": "boolean"}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "array", "items": SMALL_INT, "maxItems": 2}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
]

REGEXES = ["[0-9]{2,4}", "(cat|dog|bird)s?", "[a-c]{3}-[0-9]"]
CHOICES = [("yes", "no"), ("positive", "negative", "neutral"), ('say "hi"', "a\\b")]
GRAMMARS = ['root ::= "(" item ("," item)* ")"\nitem ::= [0-9] | "x"']
